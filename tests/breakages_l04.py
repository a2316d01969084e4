"""Breakages of the claims lesson 04 proves (see breakages.py)."""
from breakages import breaks
from breakages_l00 import qkv_cut_as_one_block  # S1's bug, also C11's

breaks("C11", "04_tp2_invariance",
       "QKV is sharded like a plain column-parallel layer: rank r takes contiguous rows of the fused [Q | K | V] "
       "weight (rank 0: Q of all 8 heads and K of 4), not Q, K and V of its own 4 heads")(qkv_cut_as_one_block)


@breaks("C12", "04_tp2_invariance", "the row-parallel bias is added on every rank, before the all-reduce")
def _bias_on_every_rank():
    import torch.nn.functional as F

    from lessons_lib.core import linear

    def forward(self, x):
        return self.group.all_reduce(F.linear(x, self.weight, self.bias), layer=self.name)

    linear.RowParallelLinear.forward = forward
