"""The claims lesson 06 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "06_prefill_engine"

breaks("S3", NOTEBOOK, "scheduler_splits_requests")
breaks("C2", NOTEBOOK, "padded_forward_skips_pad_rows", variant="pad-rows-skipped")
breaks("C8", NOTEBOOK, "masked_backend_computes_diagonal_blocks_only", variant="diagonal-blocks-only")
