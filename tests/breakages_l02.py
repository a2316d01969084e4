"""The claims lesson 02 proves, and the faults that break them (see breakages.py)."""
from breakages import breaks

NOTEBOOK = "02_linear_is_per_token"

breaks("C4", NOTEBOOK, "layer_norm_over_the_batch")
breaks("C5", NOTEBOOK, "activations_int8_per_tensor")
breaks("C6", NOTEBOOK, "qkv_sharded_as_one_block")
breaks("C4", NOTEBOOK, "mlp_exact_gelu", variant="gelu")
breaks("C6", NOTEBOOK, "row_parallel_bias_on_every_rank", variant="bias")
breaks("C4", NOTEBOOK, "residual_add_off_by_one_row", variant="residual")
breaks("C4", NOTEBOOK, "gelu_output_int8_per_tensor", variant="gelu_int8")
breaks("C6", NOTEBOOK, "block_layers_without_tp_group", variant="no_group")
breaks("C6", NOTEBOOK, "row_parallel_all_reduce_before_matmul", variant="reduce_early")
breaks("C6", NOTEBOOK, "qkv_computed_whole_on_every_rank", variant="qkv_whole")
