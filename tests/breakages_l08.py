"""The claims lesson 08 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "08_chunked_prefill"

breaks("P1", NOTEBOOK, "chunk_positions_restart_at_zero")
breaks("P2", NOTEBOOK, "chunk_takes_whole_budget")
breaks("P3", NOTEBOOK, "causal_mask_top_left")
breaks("P4", NOTEBOOK, "chunk_ignores_cached_keys")
breaks("P5", NOTEBOOK, "chunked_request_to_the_back")
breaks("P2", NOTEBOOK, "chunked_scheduler_ignores_max_num_seqs", variant="max-num-seqs")
