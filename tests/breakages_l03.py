"""The claims lesson 03 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "03_masked_vs_varlen_attention"

breaks("C7", NOTEBOOK, "attention_ignores_cu_seqlens")
breaks("C7", NOTEBOOK, "random_qkv_rows_all_equal", variant="inputs-all-equal")
breaks("C7", NOTEBOOK, "sdpa_causal_whenever_square", variant="plain-comes-out-causal")
breaks("C7", NOTEBOOK, "sdpa_output_heads_not_transposed", variant="rows-scrambled")
breaks("C8", NOTEBOOK, "block_diag_mask_all_true")
breaks("C8", NOTEBOOK, "masked_backend_computes_diagonal_blocks_only", variant="masked-computes-blocks")
breaks("C9", NOTEBOOK, "auto_backend_prefers_masked")
breaks("C9", NOTEBOOK, "masked_backend_computes_diagonal_blocks_only", variant="masked-computes-blocks")
breaks("C10", NOTEBOOK, "loop_reads_keys_from_row_zero")
breaks("C10", NOTEBOOK, "loop_causal_off_by_one", variant="causal-off-by-one")
breaks("C10", NOTEBOOK, "padded_unpad_keeps_pad_rows", variant="padded-unpad")
breaks("C10", NOTEBOOK, "sdpa_output_heads_not_transposed", variant="sdpa-rows-scrambled")
breaks("C10", NOTEBOOK, "kernel_diagonal_tile_unmasked", variant="kernel-diagonal-unmasked")
breaks("C10", NOTEBOOK, "kernel_causal_bound_one_tile_late", variant="kernel-tiles-late")
breaks("C10", NOTEBOOK, "kernel_no_early_return", variant="kernel-no-early-return")
breaks("C10", NOTEBOOK, "triton_launch_ignores_tile_sizes", variant="kernel-tiles-dropped")
