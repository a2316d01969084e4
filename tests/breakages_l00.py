"""Breakages of the claims lesson 00 proves (see breakages.py)."""
from breakages import breaks


@breaks("S1", "00_setup_one_request",
        "the fused QKV weight is cut as one contiguous block (rank 0 gets all of Q and half of K), not head by head")
def qkv_cut_as_one_block():
    """Also the breakage of C6 (breakages_l02.py) and C11 (breakages_l04.py)."""
    from lessons_lib.core import linear

    # The plain column-parallel cut: the right shapes, the wrong rows for a fused [Q | K | V] weight.
    linear.QKVParallelLinear.shard_rows = linear.ColumnParallelLinear.shard_rows


@breaks("C1", "00_setup_one_request",
        "the real all-reduce is sent in buckets of at most 64 KiB, so the number of all-reduces grows with N")
def _all_reduce_in_buckets():
    import torch.distributed as dist

    from lessons_lib.core import groups

    def all_reduce(self, tensor, *, layer=""):
        rows = max(1, 65536 // (tensor[0].numel() * tensor.element_size()))
        for chunk in tensor.split(rows):  # row blocks of a contiguous tensor: contiguous views, reduced in place
            dist.all_reduce(chunk, op=dist.ReduceOp.SUM, group=self.process_group)
            self.trace.append(groups.record(chunk, layer, self.rank, self.world_size))
        return tensor

    groups.DistGroup.all_reduce = all_reduce
