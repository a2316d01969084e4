"""The claims lesson 00 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "00_setup_one_request"

breaks("S1", NOTEBOOK, "qkv_sharded_as_one_block")
breaks("C1", NOTEBOOK, "all_reduce_in_64k_buckets")
