"""Breakages of the claims lesson 02 proves (see breakages.py)."""
from breakages import breaks
from breakages_l00 import qkv_cut_as_one_block  # S1's bug, also C6's


@breaks("C4", "02_linear_is_per_token",
        "LayerNorm takes its mean and variance over the whole flat batch (every token), not over each row")
def _layer_norm_over_the_batch():
    import types

    import torch
    import torch.nn as nn

    from lessons_lib.core import model

    class BatchStatLayerNorm(nn.LayerNorm):
        def forward(self, x):
            mean, var = x.mean(), x.var(unbiased=False)  # the bug: statistics of the whole [T, d] tensor
            return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias

    broken_nn = types.ModuleType("torch.nn")  # model.py's `nn`, with the broken LayerNorm in it
    broken_nn.__dict__.update(vars(nn))
    broken_nn.LayerNorm = BatchStatLayerNorm
    model.nn = broken_nn


@breaks("C5", "02_linear_is_per_token",
        "the linear layers round their input to int8 with ONE scale for the whole batch (per-tensor dynamic quantisation)")
def _per_tensor_activation_scale():
    import torch
    import torch.nn.functional as F

    from lessons_lib.core import linear

    def fake_int8(x):
        scale = x.abs().max() / 127  # the bug: the largest value of ANY request sets every row's grid
        return torch.round(x / scale) * scale

    def column_forward(self, x):
        return F.linear(fake_int8(x), self.weight, self.bias)

    def row_forward(self, x):
        y = self.group.all_reduce(F.linear(fake_int8(x), self.weight), layer=self.name)
        return y if self.bias is None else y + self.bias

    linear.ColumnParallelLinear.forward = column_forward  # QKVParallelLinear inherits it
    linear.RowParallelLinear.forward = row_forward


breaks("C6", "02_linear_is_per_token",
       "QKVParallelLinear cuts the fused [Q; K; V] weight as one block, like a plain column-parallel layer, "
       "so rank 0 gets all of Q and half of K instead of its 4 heads of each")(qkv_cut_as_one_block)


@breaks("C4", "02_linear_is_per_token",
        "MLP.forward applies the exact (erf) GeLU instead of its own module, GPT-2's tanh approximation",
        variant="gelu")
def _mlp_forward_with_another_gelu():
    import torch.nn.functional as F

    from lessons_lib.core import model

    def forward(self, x):
        return self.fc_down(F.gelu(self.fc_up(x)))  # the bug: not self.act (approximate="tanh")
    model.MLP.forward = forward


@breaks("C6", "02_linear_is_per_token",
        "RowParallelLinear adds the bias on every rank before the all-reduce, so the sum holds it tp times",
        variant="bias")
def _row_parallel_bias_before_the_reduce():
    import torch.nn.functional as F

    from lessons_lib.core import linear

    def forward(self, x):
        return self.group.all_reduce(F.linear(x, self.weight, self.bias), layer=self.name)  # the bug: b on each rank
    linear.RowParallelLinear.forward = forward


@breaks("C4", "02_linear_is_per_token",
        "Block.forward adds each sublayer's output to the NEXT row's residual (a fused add whose row index is off by one)",
        variant="residual")
def _residual_add_off_by_one_row():
    import torch

    from lessons_lib.core import model

    def forward(self, x):
        x = x + torch.roll(self.attn(self.ln_1(x)), 1, dims=0)  # the bug: row i gets row i-1's attention output
        return x + torch.roll(self.mlp(self.ln_2(x)), 1, dims=0)
    model.Block.forward = forward
