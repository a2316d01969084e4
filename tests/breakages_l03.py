"""The claims lesson 03 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "03_masked_vs_varlen_attention"

breaks("C7", NOTEBOOK, "attention_ignores_cu_seqlens")
breaks("C8", NOTEBOOK, "block_diag_mask_all_true")
breaks("C9", NOTEBOOK, "auto_backend_prefers_masked")
breaks("C10", NOTEBOOK, "loop_reads_keys_from_row_zero")
breaks("C10", NOTEBOOK, "loop_causal_off_by_one", variant="causal-off-by-one")
