"""Argument checks for every public entry point of lessons_lib, in one place.

Every broken rule raises ``ValueError`` naming the argument and the value
(``cu_seqlens must be int32, got int64``), never a wrong answer later. The checks run once, at
the boundary: ``varlen_attention``, ``Transformer.forward``, ``Engine.submit`` and the TP
runtime. Behind it the per-layer code trusts its inputs and never waits for the device
(no ``.tolist()``, ``.item()`` or finiteness test per layer).
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Sequence

import torch

Tensor = torch.Tensor
BATCH_FIELDS = ("input_ids", "hidden", "positions", "cu_seqlens", "max_seqlen", "seq_lens")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def is_int(value) -> bool:
    """A Python or NumPy integer, but not a bool (``True`` is not a length)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int within the bounds given; ``minimum=1`` alone reads "a positive int"."""
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        want = ("an int" if minimum is None else f"an int in [{minimum}, {maximum}]" if maximum is not None
                else "a positive int" if minimum == 1 else f"an int >= {minimum}")
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return int(value)


def check_seconds(name: str, value) -> float:
    """A deadline: a positive, finite number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_lengths(seq_lens: Sequence, minimum: int = 1, name: str = "seq_lens") -> list[int]:
    """Request lengths as Python ints, each ``>= minimum`` (0-d integer tensors accepted)."""
    out = []
    for i, n in enumerate(seq_lens):
        if isinstance(n, Tensor) and n.dim() == 0 and not n.is_floating_point() and n.dtype != torch.bool:
            n = int(n)
        if not is_int(n):
            raise ValueError(f"{name}[{i}] must be an int, got {n!r}")
        if n < minimum:
            raise ValueError(f"{name}[{i}] must be >= {minimum}, got {n}")
        out.append(int(n))
    return out


def check_token_ids(ids, where: str = "prompt_token_ids") -> list[int]:
    """A prompt as a non-empty list of Python ints >= 0 (a 1-D integer tensor or NumPy array is converted)."""
    if isinstance(ids, Tensor) or type(ids).__module__ == "numpy":
        if isinstance(ids, Tensor) and ids.device.type == "meta":
            raise ValueError(f"{where} is on the meta device: the engine needs the token values")
        if ids.ndim != 1:
            raise ValueError(f"{where} must be 1-D, got shape {tuple(ids.shape)}")
        if (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool) if isinstance(ids, Tensor) \
                else ids.dtype.kind not in "iu":
            raise ValueError(f"{where} must hold integers, got dtype {ids.dtype}")
        ids = ids.tolist()
    elif isinstance(ids, (list, tuple)):
        bad = next(((i, t) for i, t in enumerate(ids) if not is_int(t)), None)
        if bad:
            raise ValueError(f"{where}[{bad[0]}] must be an int token id, got {bad[1]!r}")
        ids = [int(t) for t in ids]
    else:
        raise ValueError(f"{where} must be a list of int token ids, got {type(ids).__name__}")
    if not ids:
        raise ValueError(f"{where} is empty: a prefill needs at least one token")
    if min(ids) < 0:
        raise ValueError(f"{where}[{ids.index(min(ids))}] is negative ({min(ids)}): token ids are >= 0")
    return ids


def check_prompt(cfg, ids: list[int], where: str) -> None:
    """A prompt a model of ``cfg`` can run: every id in the vocabulary, within ``max_position`` tokens."""
    if len(ids) > cfg.max_position:
        raise ValueError(f"{where} has {len(ids)} prompt tokens, more than max_position={cfg.max_position} "
                         "(the model has no position embedding beyond it)")
    if max(ids) >= cfg.vocab_size:
        raise ValueError(f"{where}: prompt_token_ids[{ids.index(max(ids))}]={max(ids)} is out of range "
                         f"[0, vocab_size={cfg.vocab_size})")


def _as_request_tensor(i: int, req) -> Tensor:
    if isinstance(req, Tensor):
        t = req
    elif isinstance(req, (list, tuple)):
        bad = next((x for x in req if isinstance(x, bool) or not isinstance(x, int)), None)
        if bad is not None:
            raise ValueError(f"requests[{i}] must hold int token ids, found {bad!r}")
        t = torch.tensor(req, dtype=torch.int64)
    else:
        raise ValueError(f"requests[{i}] must be a list of token ids or a tensor, got {type(req).__name__}")
    if t.dim() not in (1, 2):
        raise ValueError(f"requests[{i}] must be 1-D token ids [L] or 2-D hidden rows [L, d], got shape {tuple(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"requests[{i}] has length 0: every request needs at least one token")
    return t


def request_tensors(requests, empty: str = "requests is empty: pack needs at least one request") -> list[Tensor]:
    """``pack`` / ``pad``'s requests as tensors ``[L_i]`` or ``[L_i, d]``, each with at least one row."""
    if isinstance(requests, Tensor) or not isinstance(requests, (list, tuple)):
        raise ValueError(f"requests must be a list of requests, got {type(requests).__name__}")
    if len(requests) == 0:
        raise ValueError(empty)
    return [_as_request_tensor(i, r) for i, r in enumerate(requests)]


def check_pack_requests(requests) -> list[Tensor]:
    """``pack``'s requests: all token ids (integers >= 0) or all hidden rows of one width and dtype, one device."""
    tensors = request_tensors(requests)
    if len({t.dim() for t in tensors}) != 1:
        raise ValueError("requests mix token ids (1-D) and hidden rows (2-D); pack one kind at a time")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"requests live on different devices: {sorted({str(t.device) for t in tensors})}")
    if tensors[0].dim() == 1:
        for i, t in enumerate(tensors):
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"requests[{i}] token ids must be integers, got {t.dtype}")
            if t.device.type != "meta" and int(t.min()) < 0:
                raise ValueError(f"requests[{i}] has a negative token id {int(t.min())}")
    else:
        if len({t.shape[1] for t in tensors}) != 1:
            raise ValueError(f"hidden rows must share one width, got {sorted({t.shape[1] for t in tensors})}")
        if not tensors[0].is_floating_point() or len({t.dtype for t in tensors}) != 1:
            raise ValueError(f"hidden rows must be one floating dtype, got {sorted({str(t.dtype) for t in tensors})}")
    return tensors


def check_cu_seqlens(cu_seqlens, total_tokens: int | None = None, name: str = "cu_seqlens") -> list[int]:
    """int32, 1-D, at least 2 entries, starts at 0, non-decreasing, ends at ``total_tokens``.

    Returns the values as a Python list (the one host read of ``cu_seqlens`` per call). Repeated
    entries (a zero-length request) are accepted, as in FlashAttention.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of int32, got {type(cu_seqlens).__name__}")
    if cu_seqlens.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: its values are needed to find the requests")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D [num_seqs + 1], got shape {tuple(cu_seqlens.shape)}")
    values = cu_seqlens.tolist()
    if len(values) < 2:
        raise ValueError(f"{name} must have at least 2 entries [0, T], got {values}")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0]={values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i}]={values[i]} > {name}[{i + 1}]={values[i + 1]}")
    if total_tokens is not None and values[-1] != total_tokens:
        raise ValueError(f"{name} must end at the token count {total_tokens}, got {name}[-1]={values[-1]}")
    return values


def check_finite(t: Tensor, name: str) -> None:
    """NaN or Inf in ``t`` → ValueError naming the first bad row.

    A finite sum proves every element finite in one pass (``isfinite().all()`` was ~70x
    slower on the CPU); only a non-finite sum, which may also be an overflow, looks further.
    """
    if t.device.type == "meta" or t.numel() == 0 or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
        return
    row = int((~torch.isfinite(t)).reshape(t.shape[0], -1).any(1).nonzero()[0, 0])
    raise ValueError(f"{name} contains NaN or Inf (first at row {row})")


def check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: bool,
                      softmax_scale) -> tuple[list[int], list[int]]:
    """Every precondition of ``varlen_attention``; returns both ``cu_seqlens`` as lists."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [total_tokens, n_heads, d_head], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if not q.device == k.device == v.device == cu_seqlens_q.device == cu_seqlens_k.device:
        raise ValueError(f"q, k, v, cu_seqlens must be on one device, got q:{q.device} k:{k.device} "
                         f"v:{v.device} cu_seqlens_q:{cu_seqlens_q.device} cu_seqlens_k:{cu_seqlens_k.device}")
    if not q.shape[2] == k.shape[2] == v.shape[2]:
        raise ValueError(f"q, k, v must have the same d_head, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same n_kv_heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:  # grouped-query attention: each K/V head serves H_q / H_kv
        raise ValueError(f"q's n_heads must be a multiple of k and v's n_kv_heads (grouped-query attention), "
                         f"got n_heads={q.shape[1]}, n_kv_heads={k.shape[1]}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same total_tokens, got {k.shape[0]} and {v.shape[0]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(t, name)  # a dense backend computes 0 * NaN = NaN: one request's NaN would leak
    cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} requests but cu_seqlens_k has {len(cu_k) - 1}")
    lens_q, lens_k = lengths(cu_q), lengths(cu_k)
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if given is not None:
            check_int(name, given)
            if given < max(lens):  # a kernel sized by it would silently drop rows
                raise ValueError(f"{name}={given} is smaller than the longest request ({max(lens)})")
    if causal:
        for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
            if lk < lq:
                raise ValueError(f"causal attention needs L_k >= L_q, request {i} has L_q={lq}, L_k={lk}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale!r}")
    return cu_q, cu_k


ATTENTION_FN_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def check_attention_fn(fn):
    """``fn`` itself if it can be called as ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, causal=..., softmax_scale=...)`` (``flash_attn_varlen_func``'s contract), else
    ValueError naming what it lacks: an attention function is never called with less. A backend
    name passes through unchanged."""
    if not callable(fn):
        return fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to read, trust it
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)
    contract = (f"an attention function is called as fn({', '.join(ATTENTION_FN_ARGS)}, causal=..., "
                "softmax_scale=...) (flash_attn_varlen_func's signature)")
    params = sig.parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        missing = [kw for kw in ("causal", "softmax_scale") if kw not in keywords]
        if missing:
            raise ValueError(f"attention function {name}{sig} takes no keyword {' or '.join(missing)}: {contract}")
    try:
        sig.bind(*ATTENTION_FN_ARGS, causal=True, softmax_scale=1.0)
    except TypeError as exc:
        raise ValueError(f"attention function {name}{sig} cannot take the whole contract ({exc}): {contract}") from None
    return fn


def check_padded_qkv(q, k, v, key_mask) -> None:
    """``padded_attention``'s inputs: q ``[R, S, H, D]``, k, v ``[R, S, H_kv, D]`` (H_kv divides H), ``key_mask [R, S]``."""
    if (q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]
            or q.shape[2] % max(k.shape[2], 1) or not k.shape[2]):
        raise ValueError(f"q must be [R, S, H, D] and k, v [R, S, H_kv, D] with H_kv dividing H, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if key_mask.shape != q.shape[:2]:
        raise ValueError(f"key_mask must be [R, S] = {tuple(q.shape[:2])}, got {tuple(key_mask.shape)}")


def check_padded_ids(cfg, input_ids, attention_mask) -> tuple[int, int]:
    """``forward_padded``'s inputs: ids and mask both ``[R, S]``, ``S <= max_position``; returns ``(R, S)``."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be [R, S], got {tuple(input_ids.shape)} "
                         f"and {tuple(attention_mask.shape)}")
    r, s = input_ids.shape
    if s > cfg.max_position:
        raise ValueError(f"padded length {s} exceeds max_position={cfg.max_position}")
    return r, s


def lengths(cu: Sequence[int]) -> list[int]:
    """``[0, 10, 40]`` → ``[10, 30]``."""
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def row_starts(cu: Sequence[int], device=None) -> Tensor:
    """``[T]`` int64: the first row of each row's request (``[0, 2, 5]`` → ``[0, 0, 2, 2, 2]``), on
    ``device``; built from the host list with no device read."""
    return per_row(cu, cu[:-1], device)


def per_row(cu: Sequence[int], values: Sequence[int], device=None) -> Tensor:
    """``[T]`` int64: ``values[i]`` on every row of request i (host lists in, no device read)."""
    vals, lens = (torch.tensor(x, dtype=torch.int64, device=device) for x in (list(values), lengths(cu)))
    return vals.repeat_interleave(lens, output_size=cu[-1])


def check_num_computed(num_computed_tokens, seq_lens: Sequence[int]) -> list[int] | None:
    """A batch's ``num_computed_tokens``: None, or one int >= 0 per request (tokens already in its KV cache)."""
    if num_computed_tokens is None:
        return None
    if isinstance(num_computed_tokens, (str, bytes)) or not isinstance(num_computed_tokens, Sequence):
        raise ValueError(f"num_computed_tokens must be a list of ints, got {type(num_computed_tokens).__name__}")
    done = check_lengths(num_computed_tokens, 0, "num_computed_tokens")
    if len(done) != len(seq_lens):
        raise ValueError(f"num_computed_tokens has {len(done)} entries for {len(seq_lens)} requests")
    return done


def check_tp_divides(cfg, name: str, n: int) -> None:
    """Refuse a TP degree ``n`` that does not split ``cfg``'s heads, K/V heads and FFN over the ranks."""
    if cfg.n_heads % n or cfg.d_ffn % n:
        raise ValueError(f"{name}={n} must divide n_heads={cfg.n_heads} and d_ffn={cfg.d_ffn}")
    check_kv_heads_split(cfg.n_kv_heads, n, name)


def check_n_kv_heads(name: str, n_kv_heads, n_heads: int) -> int:
    """Grouped-query attention's K/V head count: None → ``n_heads``; else a positive int dividing ``n_heads``."""
    if n_kv_heads is None:
        return n_heads
    check_int(name, n_kv_heads, 1)
    if n_heads % n_kv_heads:
        raise ValueError(f"{name}={n_kv_heads} must divide n_heads={n_heads} (each K/V head serves a whole group "
                         "of query heads)")
    return int(n_kv_heads)


def check_kv_heads_split(n_kv_heads: int, tp: int, name: str = "tp_size", n_heads: int | None = None) -> None:
    """vLLM's rule for K/V heads under TP: each rank holds ``n_kv_heads / tp`` of them, or, when
    ``tp > n_kv_heads``, ONE, replicated on ``tp / n_kv_heads`` ranks; a ``tp`` that is neither a
    divisor nor a multiple of ``n_kv_heads`` is refused (and, given ``n_heads``, one not dividing them)."""
    if n_heads is not None and n_heads % tp:
        raise ValueError(f"n_heads={n_heads} is not divisible by {name}={tp}")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(f"{name}={tp} cannot split n_kv_heads={n_kv_heads} over the ranks: it must divide them, "
                         f"or be a multiple of them (each K/V head then replicated on {name} / n_kv_heads ranks)")


def _shape(t):
    return None if t is None else tuple(t.shape)


def check_batch(cfg, batch, device: torch.device | None = None, dtype: torch.dtype | None = None,
                name: str = "batch", cached: bool = True) -> list[int]:
    """Refuse a flat batch that a model of ``cfg`` (on ``device``, in ``dtype``) cannot run.

    The fields must agree with each other (``cu_seqlens``, ``seq_lens``, ``max_seqlen`` and
    positions that restart at 0 for every request); with a ``cfg``, token ids must lie in the
    vocabulary and every request within ``max_position``, hidden rows must be ``[T, d_model]``,
    in the model's dtype, finite. ``num_computed_tokens`` (chunks) needs ``cached``: a KV cache for
    the forward. Returns ``cu_seqlens`` as a list.
    """
    if not all(hasattr(batch, f) for f in BATCH_FIELDS):
        raise ValueError(f"{name} must be a PackedBatch (see pack), got {type(batch).__name__}")
    for field in ("input_ids", "hidden", "positions"):
        t = getattr(batch, field)
        if isinstance(t, Tensor) and t.device.type == "meta":
            raise ValueError(f"{name}.{field} is on the meta device: a forward needs its values")
    if (batch.input_ids is None) == (batch.hidden is None):
        raise ValueError(f"{name} needs exactly one of input_ids / hidden, got "
                         f"input_ids={_shape(batch.input_ids)}, hidden={_shape(batch.hidden)}")
    rows = batch.input_ids if batch.input_ids is not None else batch.hidden
    if device is not None and rows.device != device:
        raise ValueError(f"{name} is on {rows.device} but the model is on {device}")
    if batch.input_ids is not None and (rows.dim() != 1 or rows.is_floating_point() or rows.dtype == torch.bool):
        raise ValueError(f"{name}.input_ids must be 1-D integer [T], got {rows.dtype} shape {tuple(rows.shape)}")
    t = rows.shape[0]
    cu = check_cu_seqlens(batch.cu_seqlens, t, f"{name}.cu_seqlens")
    lens = lengths(cu)
    if list(batch.seq_lens) != lens:
        raise ValueError(f"{name}.seq_lens={list(batch.seq_lens)} disagrees with {name}.cu_seqlens={cu}")
    if not is_int(batch.max_seqlen) or batch.max_seqlen < max(lens):
        raise ValueError(f"{name}.max_seqlen={batch.max_seqlen!r} must be an int >= the longest request ({max(lens)})")
    pos = batch.positions
    if pos.shape != (t,) or pos.is_floating_point() or pos.dtype == torch.bool or pos.device != rows.device:
        raise ValueError(f"{name}.positions must be integer [T={t}] on {rows.device}, got {pos.dtype} "
                         f"shape {tuple(pos.shape)} on {pos.device}")
    done = check_num_computed(getattr(batch, "num_computed_tokens", None), lens)
    if not cached and any(done or ()):
        raise ValueError(f"{name} continues requests (num_computed_tokens={done}) but no kv_cache holds their "
                         "earlier tokens: pass kv_cache=")
    starts = row_starts(cu, pos.device) - (0 if done is None else per_row(cu, done, pos.device))
    bad = (pos.long() != torch.arange(t, device=pos.device) - starts).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        rule = "restart at 0 for every request" if done is None else "start at each request's num_computed_tokens"
        raise ValueError(f"{name}.positions must {rule}: row {row} has position "
                         f"{int(pos[row])}, expected {row - int(starts[row])}")
    if cfg is None:
        return cu
    if batch.input_ids is not None:
        lo, hi = (int(x) for x in torch.aminmax(rows)) if t else (0, 0)
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"{name}.input_ids must be in [0, vocab_size={cfg.vocab_size}), got min {lo}, max {hi}")
        ends = lens if done is None else [c + n for c, n in zip(done, lens)]
        if max(ends) > cfg.max_position:  # max_seqlen is only an upper bound: the real lengths decide
            raise ValueError(f"a request of {max(ends)} tokens exceeds max_position={cfg.max_position}")
    else:
        want = dtype or cfg.dtype
        if rows.dim() != 2 or rows.shape[1] != cfg.d_model or rows.dtype != want:
            raise ValueError(f"{name}.hidden must be [T, d_model={cfg.d_model}] {want}, got "
                             f"{tuple(rows.shape)} {rows.dtype}")
        check_finite(rows, f"{name}.hidden")
    return cu


def check_weights(weights, shapes: dict[str, tuple], what: str = "weights") -> None:
    """A dict holding every name of ``shapes`` as a tensor with values, of that shape."""
    if not isinstance(weights, dict):
        raise ValueError(f"{what} must be a dict of tensors (init_weights or a model's state_dict), "
                         f"got {type(weights).__name__}")
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ValueError(f"{what} are missing {len(missing)} tensors, e.g. {missing[:3]}")
    for n, shape in shapes.items():
        t = weights[n]
        if not isinstance(t, Tensor) or t.device.type == "meta":
            got = "a tensor on the meta device" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{what}[{n!r}] must be a tensor with values, got {got}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{what}[{n!r}] must have shape {tuple(shape)} for this config, got {tuple(t.shape)}")
