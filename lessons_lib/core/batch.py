"""Flat batches: many requests' tokens in one ``[T, ...]`` stream, boundaries in ``cu_seqlens``.

Request ``i`` owns rows ``[cu_seqlens[i], cu_seqlens[i+1])`` of every flat tensor (claim C3).
The same array is ``cu_seqlens`` in FlashAttention, ``cu_seq_lens_q`` in Hugging Face and
``query_start_loc`` in vLLM.

Zero-length requests: ``pack`` and ``pad`` reject them (a prompt with no token has no last
token to return); ``check_cu_seqlens`` accepts a repeated entry, as FlashAttention does, and
attention then writes no row for it.

Taught in notebooks/01_flat_batch.ipynb.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..validate import check_cu_seqlens, check_lengths, check_num_computed, check_pack_requests, request_tensors, row_starts

Tensor = torch.Tensor


def cumulative(seq_lens: Sequence[int]) -> list[int]:
    """``[L_0, L_1, ...]`` → ``[0, L_0, L_0+L_1, ...]`` (the prefix sum behind every ``cu_seqlens``)."""
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    return cu


def seq_lens_to_cu_seqlens(seq_lens: Sequence[int], device=None) -> Tensor:
    """``[L_0, L_1, ...]`` → int32 ``cu_seqlens [R+1]`` on ``device``."""
    return torch.tensor(cumulative(check_lengths(seq_lens, minimum=0)), dtype=torch.int32, device=device)


@dataclass(slots=True)
class PackedBatch:
    """R requests flattened into one stream of T tokens (no padding, no batch dimension).

    input_ids: ``[T]`` int64 token ids, or None when ``hidden`` carries the rows.
    hidden: ``[T, d_model]`` float rows (already embedded), or None.
    positions: ``[T]`` int64, request i's starting at ``num_computed_tokens[i]`` (0 unless a chunk).
    cu_seqlens: ``[R + 1]`` int32 request boundaries, on the rows' device.
    max_seqlen: int, the longest request: a varlen kernel sizes its launch grid by it.
    seq_lens: list of R ints (host copy of the lengths: no device read needed).
    num_computed_tokens: per request, its tokens already in the KV cache (vLLM's name; chunked prefill),
    or None: every request starts at token 0.
    """

    input_ids: Tensor | None
    hidden: Tensor | None
    positions: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    seq_lens: list[int]
    num_computed_tokens: list[int] | None = None

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

    def to(self, device) -> PackedBatch:
        """The same batch with every tensor on ``device`` (``seq_lens`` stays a host list)."""
        def move(t):
            return None if t is None else t.to(device)
        return PackedBatch(move(self.input_ids), move(self.hidden), move(self.positions), move(self.cu_seqlens),
                           self.max_seqlen, list(self.seq_lens), self.num_computed_tokens)


def pack(requests: Sequence, device=None, num_computed_tokens: Sequence[int] | None = None) -> PackedBatch:
    """Flatten requests into a PackedBatch.

    requests: a list of token-id lists / 1-D integer tensors ``[L_i]``, or of float tensors
    ``[L_i, d]`` (hidden rows); all of one kind. device: where the batch goes (default: the
    requests' device). num_computed_tokens: for chunks, each request's tokens already cached.
    """
    tensors = check_pack_requests(requests)
    seq_lens = [int(t.shape[0]) for t in tensors]
    if tensors[0].dim() == 1:
        input_ids, hidden = torch.cat([t.long() for t in tensors]), None
    else:
        input_ids, hidden = None, torch.cat(tensors)
    cu = cumulative(seq_lens)
    done = check_num_computed(num_computed_tokens, seq_lens)
    positions = torch.arange(cu[-1]) - row_starts(cu)  # [T] int64: 0, 1, ... restarting for every request,
    if done is not None:
        positions += torch.tensor(done).repeat_interleave(torch.tensor(seq_lens))  # ... or where its cache ends
    batch = PackedBatch(input_ids, hidden, positions, torch.tensor(cu, dtype=torch.int32), max(seq_lens), seq_lens, done)
    return batch.to(tensors[0].device if device is None else torch.device(device))


def unpack(x: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """Split a flat ``[T, ...]`` tensor back into R views ``[L_i, ...]`` (the inverse of pack)."""
    cu = check_cu_seqlens(cu_seqlens, x.shape[0] if x.dim() else None)
    return [x[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def pad(requests: Sequence, pad_value=0, pad_to: int | None = None, side: str = "right") -> tuple[Tensor, Tensor]:
    """Pad requests to ``pad_to`` rows (default: the longest): ``(padded [R, S, ...], mask [R, S] bool)``.

    ``mask[r, j]`` is True where row j of request r is a real token. ``side`` is Hugging Face's
    ``padding_side``: "right" puts each request's pad rows after its tokens, "left" before them.
    This is the naive layout of claim C2: every request carries ``S - L_r`` pad rows.
    """
    tensors = request_tensors(requests, empty="requests must be a non-empty list of requests")
    kinds = {(tuple(t.shape[1:]), t.is_floating_point()) for t in tensors}
    if len(kinds) != 1:
        raise ValueError(f"requests must all be token ids or all hidden rows of one width, got "
                         f"(row shape, floating) = {sorted(kinds)}")
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    lmax, first = max(t.shape[0] for t in tensors), tensors[0]
    if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < lmax):
        raise ValueError(f"pad_to must be an int >= the longest request ({lmax}), got {pad_to!r}")
    s = lmax if pad_to is None else pad_to
    out = torch.full((len(tensors), s, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device)
    mask = torch.zeros(len(tensors), s, dtype=torch.bool, device=first.device)
    for r, t in enumerate(tensors):
        rows = slice(0, t.shape[0]) if side == "right" else slice(s - t.shape[0], s)
        out[r, rows] = t
        mask[r, rows] = True
    return out, mask


def unpad_input(hidden_states: Tensor, attention_mask: Tensor):
    """FlashAttention's ``bert_padding.unpad_input``: ``[B, S, ...]`` + ``[B, S]`` mask → flat rows.

    Returns ``(hidden [T, ...], indices [T] int64, cu_seqlens [B+1] int32, max_seqlen int,
    seqused [B] int32)``.
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"attention_mask must be [B, S] = {tuple(hidden_states.shape[:2])}, "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    seqused = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqused, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return flat, indices, cu_seqlens, int(seqused.max()) if seqused.numel() else 0, seqused


def pad_input(hidden: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """The inverse of unpad_input: flat ``[T, ...]`` → ``[batch, seqlen, ...]``, zeros elsewhere."""
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])
