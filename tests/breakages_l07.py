"""The claims lesson 07 proves, and the faults that break them (see breakages.py). K2-K5 and K3's variants
each change ONE line of the Triton kernel (``lessons_lib.faults.kernel``); K1 puts the loop over requests
back in Python, in the engine's triton backend."""
from breakages import breaks

NOTEBOOK = "07_inside_the_kernel"

breaks("K1", NOTEBOOK, "triton_backend_launches_per_request")
breaks("K2", NOTEBOOK, "kernel_no_early_return")
breaks("K3", NOTEBOOK, "kernel_causal_bound_one_tile_late")
breaks("K4", NOTEBOOK, "kernel_columns_past_end_kept")
breaks("K5", NOTEBOOK, "kernel_sum_not_rescaled")
breaks("K3", NOTEBOOK, "kernel_every_key_tile_masked", variant="mask-all")
breaks("K3", NOTEBOOK, "kernel_diagonal_tile_unmasked", variant="diagonal-unmasked")
breaks("K3", NOTEBOOK, "kernel_causal_diagonal_top_left", variant="top-left")
