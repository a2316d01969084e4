"""The claims lesson 01 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "01_flat_batch"

breaks("S2", NOTEBOOK, "embedding_without_positions")
breaks("C2", NOTEBOOK, "pad_mask_all_true")
breaks("C3", NOTEBOOK, "positions_do_not_restart")
breaks("C2", NOTEBOOK, "padded_forward_skips_pad_rows", variant="recorded-rows")
breaks("C3", NOTEBOOK, "last_token_indices_off_by_one", variant="last-token")
breaks("C3", NOTEBOOK, "max_seqlen_is_num_tokens", variant="max-seqlen")
breaks("C3", NOTEBOOK, "pack_sorts_requests_by_length", variant="rows-in-order")
breaks("C3", NOTEBOOK, "cu_seqlens_int64", variant="cu-int32")
# Faults that flip later claim cells (a breakage fails the first one) are named in the notebook beside their
# check: bmm_recorded_as_one_head, linear_flops_per_token_one_layer, tiling_tiles_rounded_down (C2's FLOPs),
# batch_check_skips_positions (C3's refused batch), residual_add_off_by_one_row and tolerance_without_eps (C3's
# moved boundary).
