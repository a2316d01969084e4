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


def kv_replicas_round_robin(self, full):
    """``QKVParallelLinear.shard_rows`` with replicated K/V heads dealt round-robin (rank r keeps K/V head
    ``r % n_kv_heads``, not ``r // num_kv_head_replicas``): the shapes, the cache bytes and the replica count stay
    right, but a rank's queries read another group's K and V. Not registered: the MHA claim cell of C11 cannot see it
    (no replicas); tests/test_course_l04.py runs lesson 04's grouped-query C11 cell with it."""
    import torch

    r, (nq, nkv, _) = self.group.rank, self.local_sizes
    s = r % self.n_kv_heads if self.num_kv_head_replicas > 1 else r
    q, k, v = full.split([self.n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head])
    return torch.cat([q[r * nq:(r + 1) * nq], k[s * nkv:(s + 1) * nkv], v[s * nkv:(s + 1) * nkv]])
