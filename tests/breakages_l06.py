"""The claims lesson 06 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "06_prefill_engine"

breaks("S3", NOTEBOOK, "scheduler_splits_requests")
breaks("S3", NOTEBOOK, "scheduler_first_fit", variant="first-fit")
breaks("S3", NOTEBOOK, "scheduler_overshoots_budget", variant="overshoot")
breaks("S3", NOTEBOOK, "scheduler_budgets_padded_rows", variant="padded-rows-budget")
breaks("C2", NOTEBOOK, "padded_forward_skips_pad_rows", variant="pad-rows-skipped")
breaks("C2", NOTEBOOK, "flat_batch_padded_to_multiple_of_64", variant="flat-batch-padded")
breaks("C8", NOTEBOOK, "masked_backend_computes_diagonal_blocks_only", variant="diagonal-blocks-only")
breaks("C10", NOTEBOOK, "attention_ignores_cu_seqlens", variant="cu-seqlens-ignored")
breaks("C10", NOTEBOOK, "block_diag_mask_all_true", variant="masked-mixes-requests")
breaks("C11", NOTEBOOK, "attention_gathers_every_head", variant="attention-gathers")
breaks("C12", NOTEBOOK, "all_reduce_in_64k_buckets", variant="all-reduce-in-buckets")
