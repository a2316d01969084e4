"""How close is close enough: one rule for comparing two computations of the same function.

Float results are not bit-equal when the summation order changes (a flat batch, another
kernel, a TP split). Guessing an ``atol`` hides bugs in bfloat16 and flags noise in float32.
The rule, from FlashAttention's tests, asks the float64 truth instead:

    |out − ref64| ≤ 2 · max|ref − ref64| + k · eps(dtype) · max(1, max|ref64|)

``ref64`` is the function computed in float64; ``ref`` is a trusted computation in the same
dtype as ``out`` (one request at a time, TP=1, the padded reference): ``out`` may be at most
twice as far from the truth as ``ref`` is, plus ``k`` units of rounding at the output's scale
(the floor that matters where ``ref`` happens to be exact). ``eps``: 1.2e-7 in float32,
7.8e-3 in bfloat16, 9.8e-4 in float16.

Used by ``course.check.close`` (the lessons), the tests and ``tp.demo``. ``float64_twin(model)``
builds the float64 truth of a model: the same weights, upcast; ``each_alone(model, requests)`` runs each
request alone through both and gives its bound (the trusted reference of a batched run).
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor
K_ULP = 2.0


def float64_twin(model):
    """The same ``Transformer`` with every weight upcast to float64 (on the CPU): the exact-math yardstick."""
    from ..core.model import Transformer  # here, so that the rule itself needs nothing but torch

    return Transformer(model.cfg, {k: v.detach().cpu() for k, v in model.state_dict().items()}, dtype=torch.float64)


def each_alone(model, requests, twin=None) -> list[tuple[Tensor, Tensor, float]]:
    """Each request (token ids ``[L_i]``, int64, on ``model``'s device) run alone through ``model`` and its
    float64 twin (``float64_twin(model)`` unless ``twin`` is given): per request ``(out [L_i, d] in the
    model's dtype, out64 [L_i, d] float64 on the CPU, bound)``, the rule's bound for a result in that dtype."""
    twin = float64_twin(model) if twin is None else twin
    return [(r, r64, tolerance(r, r64)) for r, r64 in zip(model.forward_each(requests), twin.forward_each(requests))]


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """``max |a − b|`` in float64 (0.0 for empty tensors); shapes must match."""
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if a.numel() else 0.0


def tolerance(ref: Tensor, ref64: Tensor, dtype: torch.dtype | None = None, k: float = K_ULP) -> float:
    """The bound of the module docstring for a result in ``dtype`` (default: ``ref``'s dtype)."""
    eps = torch.finfo(dtype or ref.dtype).eps
    scale = max(1.0, ref64.detach().abs().max().item()) if ref64.numel() else 1.0
    return 2.0 * max_abs_diff(ref, ref64) + k * eps * scale


def assert_close(out: Tensor, ref: Tensor, ref64: Tensor, what: str, k: float = K_ULP) -> tuple[float, float]:
    """Raise AssertionError (naming ``what``, the error and the bound) unless ``out`` obeys the rule.

    Returns ``(error, bound)``: ``max|out − ref64|`` and the allowed maximum.
    """
    err, bound = max_abs_diff(out, ref64), tolerance(ref, ref64, out.dtype, k)
    if not err <= bound:  # NaN fails too
        raise AssertionError(f"{what}: max |out - ref64| = {err:.3e} exceeds the bound {bound:.3e} "
                             f"(2 x |ref - ref64| = {2 * max_abs_diff(ref, ref64):.3e} + {k:g} eps({out.dtype}))")
    return err, bound


def reference_lse(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor | None = None, *, causal: bool = True,
                  softmax_scale: float | None = None, dtype: torch.dtype = torch.float64) -> Tensor:
    """The log-sum-exp of each row's scaled scores from the definition, ``log Σ_j exp(scale · q_i · k_j)`` over the
    keys row i sees, computed in ``dtype`` (float64: the truth a kernel's ``return_lse`` is held to; float32: the
    trusted reference of the rule). q ``[T_q, H, D]``, k ``[T_k, H_kv, D]`` (``H % H_kv == 0``), int cu_seqlens
    ``[R+1]``; causal bottom-right (``j ≤ i + L_k − L_q``). Returns ``[H, T_q]`` on the CPU, -inf for a row that sees
    no key."""
    cu_k = cu_q if cu_k is None else cu_k
    if q.dim() != 3 or k.dim() != 3 or q.shape[1] % k.shape[1]:
        raise ValueError(f"reference_lse: q [T_q, H, D] and k [T_k, H_kv, D] with H % H_kv == 0, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    group = q.shape[1] // k.shape[1]
    q, k = q.detach().cpu().to(dtype), k.detach().cpu().to(dtype).repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for qs, qe, ks, ke in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        s = torch.einsum("ihd,jhd->hij", q[qs:qe], k[ks:ke]) * scale      # [H, L_q, L_k]
        if causal:
            i, j = torch.arange(qe - qs)[:, None], torch.arange(ke - ks)[None, :]
            s = s.masked_fill(j > i + (ke - ks) - (qe - qs), float("-inf"))
        if ke > ks:
            out[:, qs:qe] = torch.logsumexp(s, dim=-1)
    return out


def ulp32(v: float) -> float:
    """One unit in the last place of the float32 number nearest ``v``: the gap from ``|v|`` to the next
    larger float32 (between half of ``eps · |v|`` and all of it, eps = 2**-23: ``eps · |v|`` is not one ULP)."""
    a = torch.tensor(abs(v), dtype=torch.float32)
    return float(torch.nextafter(a, torch.tensor(float("inf"))) - a)


def summation_orders(n: int = 512, seed: int = 0) -> tuple[float, float, float]:
    """The same ``n`` random float32 products (``seed``) summed one by one forwards and backwards, and in float64:
    ``(forward, backward, float64)``: float addition is not associative."""
    g = torch.Generator().manual_seed(seed)
    prods = (torch.randn(n, generator=g) * torch.randn(n, generator=g)).float()
    sums = []
    for order in (prods, prods.flip(0)):
        total = torch.zeros((), dtype=torch.float32)
        for p in order:  # one float32 addition at a time, in this order
            total = total + p
        sums.append(total.item())
    return sums[0], sums[1], prods.double().sum().item()
