"""Flat batches: many requests' tokens in one ``[T, ...]`` stream, boundaries in ``cu_seqlens``.

Request ``i`` owns rows ``[cu_seqlens[i], cu_seqlens[i+1])`` of every flat tensor (claim C3).
The same array is called ``cu_seqlens`` in FlashAttention, ``cu_seq_lens_q`` in Hugging Face
and ``query_start_loc`` in vLLM.

Zero-length requests: ``pack`` and ``pad`` reject them (a prompt with no token has no last
token to return). ``validate_cu_seqlens`` accepts repeated entries, as FlashAttention does,
so a low-level caller may pass an empty segment; attention then writes no row for it.

Taught in notebooks/01_flat_batch.ipynb.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Tensor = torch.Tensor


def validate_cu_seqlens(cu_seqlens: Tensor, total_tokens: int | None = None, name: str = "cu_seqlens") -> list[int]:
    """Check a ``cu_seqlens`` tensor and return it as a Python list.

    Rules (each broken one raises ValueError naming the argument and the value):
    int32, 1-D, at least 2 entries, starts at 0, non-decreasing, ends at ``total_tokens``.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: its values are needed to find the requests")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {str(cu_seqlens.dtype).replace('torch.', '')}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries [0, T], got {cu_seqlens.tolist()}")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i}]={values[i]} > {name}[{i + 1}]={values[i + 1]}")
    if total_tokens is not None and values[-1] != total_tokens:
        raise ValueError(f"{name} must end at the token count {total_tokens}, got {name}[-1]={values[-1]}")
    return values


def seq_lens_to_cu_seqlens(seq_lens: Sequence[int], device=None) -> Tensor:
    """``[L_0, L_1, ...]`` → int32 ``[0, L_0, L_0+L_1, ...]``."""
    lens = _check_lengths(seq_lens, allow_zero=True)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _check_lengths(seq_lens: Sequence[int], allow_zero: bool = False) -> list[int]:
    out = []
    for i, n in enumerate(seq_lens):
        if isinstance(n, bool) or not isinstance(n, int):
            if isinstance(n, torch.Tensor) and n.dim() == 0 and not n.is_floating_point():
                n = int(n)
            else:
                raise ValueError(f"seq_lens[{i}] must be an int, got {n!r}")
        if n < 0 or (n == 0 and not allow_zero):
            raise ValueError(f"seq_lens[{i}] must be {'>= 0' if allow_zero else '>= 1'}, got {n}")
        out.append(n)
    return out


@dataclass(slots=True)
class PackedBatch:
    """R requests flattened into one stream of T tokens (no padding, no batch dimension).

    input_ids: ``[T]`` int64 token ids, or None when ``hidden`` carries the rows.
    hidden: ``[T, d_model]`` float rows (already embedded), or None.
    positions: ``[T]`` int64, restarting at 0 for every request.
    cu_seqlens: ``[R + 1]`` int32 request boundaries.
    max_seqlen: int, the longest request (what varlen kernels size their tiles by).
    seq_lens: list of R ints.
    """

    input_ids: Tensor | None
    hidden: Tensor | None
    positions: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    seq_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def last_token_indices(self) -> Tensor:
        """``[R]`` int64: the flat row of each request's last token (``cu_seqlens[1:] - 1``)."""
        return self.cu_seqlens[1:].long() - 1

    def validate(self, name: str = "batch") -> list[int]:
        """Check that the fields agree with each other; return ``cu_seqlens`` as a list.

        A hand-built batch whose ``positions`` do not restart per request, whose ``seq_lens``
        disagree with ``cu_seqlens`` or whose ``max_seqlen`` is below the real maximum would
        give a silently wrong forward; each raises ValueError naming the field and value.
        """
        if (self.input_ids is None) == (self.hidden is None):
            raise ValueError(f"{name} needs exactly one of input_ids / hidden, got "
                             f"input_ids={_shape(self.input_ids)}, hidden={_shape(self.hidden)}")
        rows = self.input_ids if self.input_ids is not None else self.hidden
        if self.input_ids is not None and (rows.dim() != 1 or rows.is_floating_point() or rows.is_complex()
                                           or rows.dtype == torch.bool):
            raise ValueError(f"{name}.input_ids must be 1-D integer [T], got {rows.dtype} shape {tuple(rows.shape)}")
        if self.hidden is not None and (rows.dim() != 2 or not rows.is_floating_point()):
            raise ValueError(f"{name}.hidden must be 2-D floating [T, d], got {rows.dtype} shape {tuple(rows.shape)}")
        t = rows.shape[0]
        cu = validate_cu_seqlens(self.cu_seqlens, t, f"{name}.cu_seqlens")
        lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        if list(self.seq_lens) != lens:
            raise ValueError(f"{name}.seq_lens={list(self.seq_lens)} disagrees with {name}.cu_seqlens={cu}")
        if isinstance(self.max_seqlen, bool) or not isinstance(self.max_seqlen, int) or self.max_seqlen < max(lens):
            raise ValueError(f"{name}.max_seqlen={self.max_seqlen!r} must be an int >= the longest request ({max(lens)})")
        pos = self.positions
        if pos.shape != (t,) or pos.is_floating_point() or pos.dtype == torch.bool or pos.device != rows.device:
            raise ValueError(f"{name}.positions must be integer [T={t}] on {rows.device}, got {pos.dtype} "
                             f"shape {tuple(pos.shape)} on {pos.device}")
        starts = torch.tensor(cu[:-1], dtype=torch.int64, device=pos.device)
        expected = torch.arange(t, device=pos.device) - torch.repeat_interleave(
            starts, torch.tensor(lens, device=pos.device))  # [T]: 0, 1, ... restarting per request
        bad = (pos.long() != expected).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise ValueError(f"{name}.positions must restart at 0 for every request: row {row} has position "
                             f"{int(pos[row])}, expected {int(expected[row])}")
        return cu

    def to(self, device) -> "PackedBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedBatch(move(self.input_ids), move(self.hidden), move(self.positions),
                           move(self.cu_seqlens), self.max_seqlen, list(self.seq_lens))


def _shape(t: Tensor | None):
    return None if t is None else tuple(t.shape)


def _as_request_tensor(i: int, req) -> Tensor:
    if isinstance(req, torch.Tensor):
        t = req
    elif isinstance(req, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in req):
            bad = next(x for x in req if not (isinstance(x, int) and not isinstance(x, bool)))
            raise ValueError(f"requests[{i}] must hold int token ids, found {bad!r}")
        t = torch.tensor(req, dtype=torch.int64)
    else:
        raise ValueError(f"requests[{i}] must be a list of token ids or a tensor, got {type(req).__name__}")
    if t.dim() == 0 or t.dim() > 2:
        raise ValueError(f"requests[{i}] must be 1-D token ids [L] or 2-D hidden rows [L, d], got shape {tuple(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"requests[{i}] has length 0: every request needs at least one token")
    return t


def pack(requests: Sequence, device=None) -> PackedBatch:
    """Flatten requests into a PackedBatch.

    requests: a list of token-id lists / 1-D int tensors ``[L_i]``, or of float tensors
    ``[L_i, d]`` (hidden rows). All requests must be of the same kind.
    """
    if isinstance(requests, torch.Tensor) or not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of requests, got {type(requests).__name__}")
    if len(requests) == 0:
        raise ValueError("requests is empty: pack needs at least one request")
    tensors = [_as_request_tensor(i, r) for i, r in enumerate(requests)]
    kinds = {t.dim() for t in tensors}
    if len(kinds) != 1:
        raise ValueError("requests mix token ids (1-D) and hidden rows (2-D); pack one kind at a time")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"requests live on different devices: {sorted(map(str, devices))}")
    seq_lens = [int(t.shape[0]) for t in tensors]
    if tensors[0].dim() == 1:
        for i, t in enumerate(tensors):
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"requests[{i}] token ids must be integers, got {t.dtype}")
            if t.numel() and int(t.min()) < 0:
                raise ValueError(f"requests[{i}] has a negative token id {int(t.min())}")
        input_ids, hidden = torch.cat([t.long() for t in tensors]), None
    else:
        widths = {t.shape[1] for t in tensors}
        if len(widths) != 1:
            raise ValueError(f"hidden rows must share one width, got {sorted(widths)}")
        if not tensors[0].is_floating_point() or len({t.dtype for t in tensors}) != 1:
            raise ValueError(f"hidden rows must be one floating dtype, got {sorted({str(t.dtype) for t in tensors})}")
        input_ids, hidden = None, torch.cat(tensors)
    dev = tensors[0].device if device is None else torch.device(device)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens])
    batch = PackedBatch(input_ids, hidden, positions, seq_lens_to_cu_seqlens(seq_lens),
                        max(seq_lens), seq_lens)
    return batch.to(dev)


def unpack(x: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """Split a flat ``[T, ...]`` tensor back into R views ``[L_i, ...]`` (inverse of pack)."""
    cu = validate_cu_seqlens(cu_seqlens, x.shape[0] if x.dim() else None)
    return [x[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def pad(requests: Sequence, pad_value=0) -> tuple[Tensor, Tensor]:
    """Right-pad requests to the longest: returns ``(padded [R, Lmax, ...], mask [R, Lmax] bool)``.

    ``mask[r, j]`` is True where row j of request r is a real token. This is the naive
    layout of claim C2: every request carries ``Lmax - L_r`` pad rows.
    """
    if isinstance(requests, torch.Tensor) or not isinstance(requests, (list, tuple)) or len(requests) == 0:
        raise ValueError("requests must be a non-empty list of requests")
    tensors = [_as_request_tensor(i, r) for i, r in enumerate(requests)]
    kinds = {(tuple(t.shape[1:]), t.is_floating_point()) for t in tensors}
    if len(kinds) != 1:
        raise ValueError(f"requests must all be token ids or all hidden rows of one width, got "
                         f"(row shape, floating) = {sorted(kinds)}")
    lmax = max(t.shape[0] for t in tensors)
    first = tensors[0]
    out = torch.full((len(tensors), lmax, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device)
    mask = torch.zeros(len(tensors), lmax, dtype=torch.bool, device=first.device)
    for r, t in enumerate(tensors):
        out[r, : t.shape[0]] = t
        mask[r, : t.shape[0]] = True
    return out, mask


def unpad_input(hidden_states: Tensor, attention_mask: Tensor):
    """FlashAttention-compatible: ``[B, S, ...]`` + ``[B, S]`` mask → flat rows.

    Returns ``(hidden [T, ...], indices [T] int64, cu_seqlens [B+1] int32, max_seqlen int,
    seqused [B] int32)`` as ``flash_attn.bert_padding.unpad_input`` does.
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"attention_mask must be [B, S] = {tuple(hidden_states.shape[:2])}, "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    seqused = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqused, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return flat, indices, cu_seqlens, int(seqused.max()) if seqused.numel() else 0, seqused


def pad_input(hidden: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of unpad_input: flat ``[T, ...]`` → ``[batch, seqlen, ...]`` with zeros elsewhere."""
    out = torch.zeros(batch * seqlen, *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])
