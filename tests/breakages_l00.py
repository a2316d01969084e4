"""The claims lesson 00 proves, and the faults that break them (see breakages.py). The notebook's summary names
the faults that break later claim cells only (``mlp_exact_gelu``, ``row_parallel_no_all_reduce``)."""
from breakages import breaks

NOTEBOOK = "00_setup_one_request"

breaks("S1", NOTEBOOK, "qkv_sharded_as_one_block")
breaks("S1", NOTEBOOK, "column_parallel_bias_whole", variant="column-bias")
breaks("S1", NOTEBOOK, "row_parallel_bias_sharded", variant="row-bias")
breaks("C1", NOTEBOOK, "all_reduce_in_64k_buckets")
breaks("C1", NOTEBOOK, "all_reduce_twice", variant="all-reduce-twice")
