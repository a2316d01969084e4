"""Breakages of the claims lesson 04 proves (see breakages.py)."""
from breakages import breaks


@breaks("C12", "04_tp2_invariance", "the row-parallel bias is added on every rank, before the all-reduce")
def _bias_on_every_rank():
    import torch.nn.functional as F

    from lessons_lib.core import linear

    def forward(self, x):
        y = self.group.all_reduce(F.linear(x, self.weight, self.bias), layer=self.name)
        return y

    linear.RowParallelLinear.forward = forward
