"""Faults of the flat batch (``core.batch``): pack, pad, last_token_indices, max_seqlen."""
from __future__ import annotations

import torch

from .registry import fault, swap_attr, swap_function

AREA = "batch"


@fault("pad_mask_all_true", "pad returns a mask that is all True: pad rows are counted (and attended) as real", AREA)
def _pad_mask_all_true():
    from ..core import batch
    real = batch.pad

    def pad(requests, pad_value=0, **kw):
        out, mask = real(requests, pad_value, **kw)
        return out, torch.ones_like(mask)
    return [swap_function(batch, "pad", pad)]


@fault("positions_do_not_restart", "pack numbers positions 0..T-1 across the batch instead of restarting at 0 for "
       "every request", AREA)
def _positions_do_not_restart():
    from ..core import batch
    real = batch.pack

    def pack(requests, device=None, **kw):
        out = real(requests, device, **kw)
        out.positions = torch.arange(out.num_tokens, device=out.positions.device)
        return out
    return [swap_function(batch, "pack", pack)]


@fault("pack_refused", "pack raises: whoever needs a flat batch must build input_ids, positions and cu_seqlens "
       "itself (an exercise's guard)", AREA)
def _pack_refused():
    from ..core import batch

    def pack(*args, **kwargs):
        raise RuntimeError("pack is switched off here (fault 'pack_refused'): build input_ids, positions and "
                           "cu_seqlens yourself")
    return [swap_function(batch, "pack", pack)]


@fault("last_token_indices_off_by_one", "PackedBatch.last_token_indices is one row early (cu_seqlens[1:] - 2): a "
       "server samples each request's next token from its second-to-last row", AREA)
def _last_token_indices_off_by_one():
    from ..core import batch
    return [swap_attr(batch.PackedBatch, "last_token_indices", property(lambda self: self.cu_seqlens[1:].long() - 2))]


@fault("max_seqlen_is_num_tokens", "pack sets max_seqlen to the batch's token count instead of its longest request: "
       "the batch check passes (it is an upper bound), and a varlen kernel sizes its launch grid for one T-token request",
       AREA)
def _max_seqlen_is_num_tokens():
    from ..core import batch
    real = batch.pack

    def pack(requests, device=None, **kw):
        out = real(requests, device, **kw)
        out.max_seqlen = out.num_tokens
        return out
    return [swap_function(batch, "pack", pack)]


@fault("pack_sorts_requests_by_length", "pack lays the requests' tokens longest first (as a length-sorting packer "
       "does) but keeps cu_seqlens, positions and seq_lens in arrival order: rows cu[i]..cu[i+1]-1 hold another "
       "request's tokens", AREA)
def _pack_sorts_requests_by_length():
    from ..core import batch
    real = batch.pack

    def pack(requests, device=None, **kw):
        out = real(requests, device, **kw)
        if out.input_ids is not None:
            ids = [torch.as_tensor(r) for r in requests]
            out.input_ids = torch.cat(sorted(ids, key=len, reverse=True)).to(out.input_ids.device)
        return out
    return [swap_function(batch, "pack", pack)]


@fault("cu_seqlens_int64", "pack keeps cu_seqlens in int64, torch.cumsum's dtype, instead of the int32 varlen "
       "kernels take", AREA)
def _cu_seqlens_int64():
    from ..core import batch
    real = batch.pack

    def pack(requests, device=None, **kw):
        out = real(requests, device, **kw)
        out.cu_seqlens = out.cu_seqlens.long()
        return out
    return [swap_function(batch, "pack", pack)]


@fault("batch_check_skips_positions", "validate.check_batch no longer compares each row's position with the one "
       "cu_seqlens gives it: a flat batch whose positions do not restart runs", AREA)
def _batch_check_skips_positions():
    import dataclasses

    from .. import validate
    real = validate.check_batch

    def check_batch(cfg, batch, *args, **kwargs):
        try:
            return real(cfg, batch, *args, **kwargs)
        except ValueError as exc:
            if "positions must restart" not in str(exc):
                raise
            cu = batch.cu_seqlens.tolist()
            starts = validate.row_starts(cu, batch.positions.device)
            agreeing = torch.arange(len(starts), device=starts.device) - starts
            return real(cfg, dataclasses.replace(batch, positions=agreeing), *args, **kwargs)
    return [swap_function(validate, "check_batch", check_batch)]
