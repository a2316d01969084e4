"""The prefill KV cache of chunked prefill: the keys and values of the prompt tokens already run.

A prompt longer than the token budget is prefilled in chunks, one per forward (vLLM's
``enable_chunked_prefill``). Chunk c's queries must attend to every earlier token of its prompt,
whose keys and values were computed by earlier forwards: this cache keeps them, per request and
per layer, as ``[num_computed_tokens, H_kv_local, D]`` tensors on the model's device, in its dtype:
the K/V heads only, ``n_kv_heads`` of them under grouped-query attention (under TP each rank caches
its own K/V heads only). At TP=1 it holds ``measure.flops.kv_cache_bytes(cfg, lens, bytes_per_element=...)``
bytes for cached lengths ``lens``. Nothing else is cached: no decode, no pages.

One forward = one ``KVCacheStep`` (``PrefillKVCache.step``). In every layer the attention core
calls ``step.keys_values(layer, k, v)``: for each request of the batch, its cached keys, then its
chunk's, concatenated in batch order — the ``[T_k, H_kv, D]`` keys that ``cu_seqlens_k`` (cached +
chunk lengths) describes, read by ONE varlen call with causal masking aligned bottom-right.
The step stages what must be kept; ``finish()`` commits it after the forward and frees each
request whose last chunk ran. A failed forward (no ``finish``) leaves the cache as it was.

Taught in notebooks/08_chunked_prefill.ipynb.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..validate import check_int, check_lengths, dtype_name

Tensor = torch.Tensor


class PrefillKVCache:
    """Per request id, per layer: keys and values ``[num_computed_tokens, n_kv_heads, d_head]``.

    n_layers, n_kv_heads (this rank's K/V heads), d_head: the model's; device, dtype: where and in what
    the keys live (the model's). ``nbytes``: bytes held now; ``peak_bytes``: the most ever held,
    the staged keys of a forward in flight included.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, d_head: int, *, device="cpu", dtype: torch.dtype = torch.float32):
        self.n_layers, self.n_kv_heads = check_int("n_layers", n_layers, 1), check_int("n_kv_heads", n_kv_heads, 1)
        self.d_head = check_int("d_head", d_head, 1)
        self.device, self.dtype = torch.device(device), dtype
        self._kv: dict = {}   # request id -> [(k, v) per layer], each [num_computed_tokens, H_kv, D]
        self.nbytes = self.peak_bytes = 0

    @classmethod
    def for_model(cls, model) -> PrefillKVCache:
        """An empty cache for ``model`` (a ``core.model.Transformer``): its layers, THIS rank's K/V heads."""
        qkv = model.layers[0].attn.qkv
        return cls(len(model.layers), qkv.n_local_kv_heads, qkv.d_head, device=model.device, dtype=model.dtype)

    def num_computed_tokens(self, request_id) -> int:
        """Tokens of ``request_id`` whose keys are cached (0 if none)."""
        entry = self._kv.get(request_id)
        return 0 if entry is None else int(entry[0][0].shape[0])

    def __contains__(self, request_id) -> bool:
        return request_id in self._kv

    def __len__(self) -> int:
        return len(self._kv)

    def free(self, request_id) -> None:
        """Drop ``request_id``'s keys and values (no-op if it has none)."""
        entry = self._kv.pop(request_id, None)
        if entry is not None:
            self.nbytes -= sum(_bytes(k) + _bytes(v) for k, v in entry)

    def clear(self) -> None:
        self._kv.clear()
        self.nbytes = 0

    def step(self, request_ids: Sequence, num_computed_tokens: Sequence[int], num_new_tokens: Sequence[int],
             keep: Sequence[bool]) -> KVCacheStep:
        """Begin one forward over these requests, in batch order.

        num_computed_tokens[i]: tokens of request i already run (its chunk starts there; 0 for a
        request's first chunk, which drops any stale entry a failed run left). num_new_tokens[i]:
        its chunk's length. keep[i]: more chunks follow, so keep its keys after this forward.
        Raises ValueError when the cache does not hold exactly ``num_computed_tokens[i]`` tokens.
        """
        ids, n = list(request_ids), len(request_ids)
        done = check_lengths(num_computed_tokens, 0, "num_computed_tokens")
        new = check_lengths(num_new_tokens, 1, "num_new_tokens")
        if not len(done) == len(new) == len(keep) == n:
            raise ValueError(f"request_ids, num_computed_tokens, num_new_tokens and keep must have one entry per "
                             f"request, got {n}, {len(done)}, {len(new)}, {len(keep)}")
        if len(set(ids)) != n:
            raise ValueError(f"request_ids must be distinct within one forward, got {ids}")
        bad = next((k for k in keep if not isinstance(k, bool)), None)
        if bad is not None:
            raise ValueError(f"keep must hold bools, got {bad!r}")
        for rid, c in zip(ids, done):
            if c == 0:
                self.free(rid)  # a first chunk: whatever an aborted run left is stale
            elif self.num_computed_tokens(rid) != c:
                raise ValueError(f"request {rid!r}: the KV cache holds {self.num_computed_tokens(rid)} tokens, "
                                 f"the chunk says num_computed_tokens={c}")
        return KVCacheStep(self, ids, done, new, list(keep))

    def __repr__(self) -> str:
        return (f"PrefillKVCache({len(self)} requests, {self.nbytes:,} B, peak {self.peak_bytes:,} B, "
                f"{self.n_layers} layers x {self.n_kv_heads} K/V heads x {self.d_head}, {dtype_name(self.dtype)})")


class KVCacheStep:
    """One forward's view of a ``PrefillKVCache`` (built by ``PrefillKVCache.step``)."""

    def __init__(self, cache: PrefillKVCache, request_ids: list, num_computed_tokens: list[int],
                 num_new_tokens: list[int], keep: list[bool]):
        self.cache, self.request_ids, self.keep = cache, request_ids, keep
        self.num_computed_tokens, self.num_new_tokens = num_computed_tokens, num_new_tokens
        self._staged: dict = {rid: [None] * cache.n_layers for rid, k in zip(request_ids, keep) if k}
        self._staged_bytes = 0
        self._reads = any(num_computed_tokens)

    def keys_values(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """This chunk's ``k, v [T_q, H_kv, D]`` → every key and value the batch's queries read, ``[T_k, H_kv, D]``:
        per request (batch order) its cached rows then its chunk's. Python ints only: no device sync."""
        if not self._reads and not self._staged:  # nothing cached, nothing to keep: the plain forward
            return k, v
        ks, vs, row = [], [], 0
        for rid, c, n in zip(self.request_ids, self.num_computed_tokens, self.num_new_tokens):
            k_i, v_i = k[row:row + n], v[row:row + n]
            row += n
            if c:
                old_k, old_v = self.cache._kv[rid][layer]
                k_i, v_i = torch.cat([old_k, k_i]), torch.cat([old_v, v_i])  # [c + n, H_kv, D]
            if rid in self._staged:  # more chunks follow: keep a copy of its own (not a view of qkv's output)
                k_i, v_i = (k_i.clone(), v_i.clone()) if not c else (k_i, v_i)
                self._staged[rid][layer] = (k_i, v_i)
                self._staged_bytes += _bytes(k_i) + _bytes(v_i)
                self.cache.peak_bytes = max(self.cache.peak_bytes, self.cache.nbytes + self._staged_bytes)
            ks.append(k_i)
            vs.append(v_i)
        if not self._reads:  # no request read a cached key: the chunk's own k, v are the keys
            return k, v
        return torch.cat(ks), torch.cat(vs)

    def finish(self) -> None:
        """After a successful forward: commit the kept requests' keys, free those whose last chunk ran."""
        cache = self.cache
        for rid, layers in self._staged.items():
            if any(x is None for x in layers):
                raise RuntimeError(f"request {rid!r}: the forward did not reach every layer; nothing was committed")
        for rid in self.request_ids:
            cache.free(rid)
        for rid, layers in self._staged.items():
            cache._kv[rid] = layers
            cache.nbytes += sum(_bytes(k) + _bytes(v) for k, v in layers)
        cache.peak_bytes = max(cache.peak_bytes, cache.nbytes)
        self._staged = {}


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def cache_rows_held(forwards: Sequence, seq_lens: Sequence[int]) -> dict:
    """Token rows per layer (K and V together) a prefill KV cache holds at its peak, for forwards given as chunks
    ``(request, start, length)`` (``BatchStats`` objects, their ``chunks``, or a chunked ``plan_batches`` plan) of
    requests with prompt lengths ``seq_lens``. ``copy``: ``KVCacheStep``'s (the cached rows read beside their
    ``torch.cat`` copies with the chunks of the requests that continue; ``PrefillKVCache.peak_bytes`` in rows);
    ``in_place``: a cache written in place, between forwards (the rows of the requests not finished), with
    ``held_by`` (the request holding most of them) and ``held_after`` (the forward after which, from 0);
    ``in_forward``: that cache while a forward runs (every scheduled token's K and V written before attention)."""
    out = {"copy": 0, "in_place": 0, "in_forward": 0, "held_by": None, "held_after": None}
    for f, fwd in enumerate(getattr(x, "chunks", x) for x in forwards):
        kept = [(s + n, i) for i, s, n in fwd if s + n < seq_lens[i]]
        out["copy"] = max(out["copy"], sum(s for _, s, _ in fwd) + sum(r for r, _ in kept))
        out["in_forward"] = max(out["in_forward"], sum(s + n for _, s, n in fwd))
        if sum(r for r, _ in kept) > out["in_place"]:
            out.update(in_place=sum(r for r, _ in kept), held_by=max(kept)[1], held_after=f)
    return out
