"""The claims lesson 05 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "05_flop_regimes"

breaks("C13", NOTEBOOK, "linear_rows_in_chunks_of_16")
breaks("C14", NOTEBOOK, "loop_backend_runs_masked")
breaks("C15", NOTEBOOK, "model_runs_requests_one_at_a_time")
breaks("C15", NOTEBOOK, "kv_repeated_before_cache", variant="gqa")
breaks("C15", NOTEBOOK, "loop_repeats_kv_per_query_head", variant="unpacked")
