"""Does a step of the model give each request what it gets alone? The flat batch's steps, measured one at a time.

A server may batch requests flat only if no step lets one request's rows change another's. Two tests decide
it for any step ``fn`` on the flat rows (lesson 02): which output rows change when one input row changes (a bool
``[T, T]`` map, e.g. ``course.probe.row_dependency``; ``reach_counts`` reads it), and each request run ALONE
against its rows of the flat run (``alone_vs_batched``; ``step_report`` for a block's step, against float64 too).

``block_steps(model, x, seq_lens)`` cuts the first block of a ``Transformer`` into its ten steps (LayerNorm, QKV,
attention, out proj, residual add, ...) as ``Block.forward`` runs them: forward hooks read every value off one
real ``block(x)``, and a residual add, a ``+`` inside ``Block.forward`` with no module of its own, is measured on
the block itself (``block_sum``: the block run with the added sublayer's output replaced). ``forward_walk`` gives
the steps' shapes from the config alone; ``fake_int8`` rounds activations to int8 with the scale of one of
``QUANT_SCHEMES`` (some read other requests' rows); ``format_reports``, ``rounding_lines``, ``rows_alone_lines`` print what
was measured (machine-dependent counts: shown, never asserted).

Taught in notebooks/02_linear_is_per_token.ipynb.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..core.attention import VarlenMetadata
from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..core.model import AttentionContext
from ..style import request_name
from ..validate import check_choice, check_int, check_lengths
from .flops import linear_shapes
from .recorder import module_io
from .tolerance import float64_twin, max_abs_diff, tolerance, ulp32

Tensor = torch.Tensor
ALONE_RTOL = 1e-5  # alone vs in the batch: rounding allowed, relative to the largest output number (no floor)


def reach_counts(dep: np.ndarray, seq_lens: Sequence[int]) -> dict:
    """What a bool ``[T, T]`` map (True where input row j changed output row i) on the flat batch of ``seq_lens``
    shows: pairs on the ``diagonal``, ``own_request`` (row i changed by another row of its request),
    ``other_requests``, ``later`` (changed by a later row j > i of its request: not causal), ``reads`` in words,
    and ``across_from``: the input rows j (sorted ints) that changed a row of another request."""
    dep = np.asarray(dep, dtype=bool)
    owner = np.repeat(np.arange(len(seq_lens)), list(seq_lens))
    same = owner[:, None] == owner[None, :]
    diagonal = int(np.trace(dep))
    own, other = int((dep & same).sum()) - diagonal, int((dep & ~same).sum())
    later = int(np.triu(dep & same, k=1).sum())
    reads = ("other requests too" if other else "row i only" if not own
             else "rows of its own request" if later else "rows ≤ i of its own request")
    return {"diagonal": diagonal, "own_request": own, "other_requests": other, "later": later, "reads": reads,
            "across_from": np.flatnonzero((dep & ~same).any(axis=0)).tolist()}


@torch.no_grad()
def alone_vs_batched(fn: Callable[[Tensor, list[int]], Tensor], x: Tensor, seq_lens: Sequence[int],
                     rtol: float = ALONE_RTOL) -> dict:
    """Each request's rows of ``x [T, ...]`` run ALONE through ``fn(t, cu_seqlens)`` against its rows of the flat run:
    ``{"max_diff", "bound" (``rtol`` x the flat output's largest |number|, no floor), "differ" (names of the requests
    beyond it, ``request_name``), "flat", "row_diff" (float64 [T]: each row's max |alone - flat|)}``.
    A request alone gets ``cu_seqlens = [0, its length]``; ValueError if ``fn`` does not give one row per input row."""
    lens = check_lengths(seq_lens)
    cu = cumulative(lens)
    flat = fn(x, cu)
    if not isinstance(flat, Tensor) or flat.dim() < 1 or flat.shape[0] != cu[-1]:
        got = list(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
        raise ValueError(f"the module must return one row per input row: {cu[-1]} rows in, got {got}")
    bound = rtol * float(flat.double().abs().max())
    worst, differ, row_diff = 0.0, [], np.zeros(cu[-1])
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        alone = fn(x[s:e], [0, e - s])
        if not isinstance(alone, Tensor) or alone.shape != flat[s:e].shape:
            got = list(alone.shape) if isinstance(alone, Tensor) else type(alone).__name__
            raise ValueError(f"request {request_name(i)} alone ({e - s} rows) gave {got}, not {list(flat[s:e].shape)}")
        gap = (alone.double() - flat[s:e].double()).abs().reshape(e - s, -1)
        row_diff[s:e] = gap.amax(dim=1).numpy() if gap.shape[1] else 0.0
        d = float(gap.max()) if gap.numel() else 0.0
        worst = max(worst, d)
        if not d <= bound:  # a NaN differs too
            differ.append(request_name(i))
    return {"max_diff": worst, "bound": bound, "differ": differ, "flat": flat, "row_diff": row_diff}


QUANT_SCHEMES = ("per-tensor static", "per-tensor dynamic", "per-feature dynamic", "per-token dynamic")
CALIBRATED_SCALE = 0.04  # a per-tensor scale fixed once, offline, from sample activations (max |x| ~ 5)


def fake_int8(x: Tensor, scheme: str) -> Tensor:
    """Symmetric int8 fake quantisation of the activations ``x [T, d]`` (rounded to ``round(x / s) · s``,
    clamped to ±127 levels) with the scale ``s`` of ``scheme`` (one of ``QUANT_SCHEMES``): ``CALIBRATED_SCALE``
    (static), or ``max |x| / 127`` over the whole tensor, over each feature's tokens, or over each token's
    features (dynamic). A max of 0 keeps the values (zeros stay zeros). Same shape and dtype as ``x``.
    Only the static and per-token scales read no other row: the other two make one request's rows depend on
    the others' (lesson 02, exercise 02.3)."""
    check_choice("scheme", scheme, QUANT_SCHEMES)
    if scheme == "per-tensor static":
        s = torch.tensor(CALIBRATED_SCALE, dtype=x.dtype)
    else:
        dims = {"per-tensor dynamic": (0, 1), "per-feature dynamic": (0,), "per-token dynamic": (1,)}[scheme]
        s = x.abs().amax(dim=dims, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(x / s), -127, 127) * s


@contextmanager
def attention_context(model, cu_seqlens: Sequence[int], backend, device=None):
    """``with attention_context(model, cu, backend):`` every layer of the ``Transformer`` ``model`` holds the
    attention context of a flat batch with these ``cu_seqlens`` (``Transformer.set_context``, as its forward
    does), so a block or an attention core can run on its own; cleared again on exit."""
    model.set_context(AttentionContext(VarlenMetadata.build(list(cu_seqlens), device=device or model.device), backend))
    try:
        yield model
    finally:
        model.set_context(None)  # a context never outlives its forward


def module_step(model, path: str, backend: str = "loop") -> Callable[[Tensor, Sequence[int]], Tensor]:
    """``fn(t, cu_seqlens)``: the module at ``path`` (``"ln_1"``, ``"attn.qkv"``, ``"mlp"``, ...) of the first block of
    the ``Transformer`` ``model``, alone, on the flat rows ``t [T, in]``. ``"attn.core"`` (varlen causal attention,
    ``backend``) takes the fused QKV output ``[T, 3·H·D]`` and gives ``[T, H·D]`` under the attention context of
    ``cu_seqlens``, as the block calls it; every other module ignores ``cu_seqlens``."""
    block = model.layers[0]
    if path != "attn.core":
        return lambda t, cu: block.get_submodule(path)(t)

    def core(t, cu):
        with attention_context(model, cu, backend, t.device):
            return block.attn.core(*block.attn.qkv.split(t)).flatten(1)
    return core


def block_sum(block, x: Tensor, outputs: Mapping[str, Tensor], read: str) -> Tensor:
    """Run the engine's ``block(x)`` (a ``Block``, its attention context set) with the output of each module
    ``outputs`` names (``"attn.out_proj"``, ``"mlp.fc_down"``) replaced by the given tensor, and return a residual
    sum where ``Block.forward`` leaves it: ``read="ln_2"`` the first (``ln_2``'s input), ``""`` the second (the
    block's output). ``[T, d] -> [T, d]``; the add is the block's own ``+``."""
    handles = [block.get_submodule(p).register_forward_hook(lambda _m, _args, _out, y=y: y) for p, y in outputs.items()]
    try:
        seen = module_io(block, [read], lambda: block(x))
    finally:
        for h in handles:
            h.remove()
    return seen[read][0][0] if read else seen[read][1]


def _cu_of(cu: list[int], rows: slice) -> list[int]:
    start = rows.start or 0
    stop = cu[-1] if rows.stop is None else rows.stop
    inside = [c - start for c in cu if start <= c <= stop]
    if inside[0] != 0 or inside[-1] != stop - start:
        raise ValueError(f"rows {rows} do not cut whole requests of cu_seqlens {cu}")
    return inside


@dataclass
class BlockStep:
    """One step of a real block: ``fn(t, rows)`` maps the rows ``t`` of the flat batch at ``rows``
    (a slice that cuts whole requests) like the block does; ``fn64`` is the same step of a float64
    twin of the block. ``inp`` / ``out``: what the step got and gave in the whole flat forward."""

    name: str
    kind: str
    fn: Callable
    fn64: Callable
    inp: Tensor
    out: Tensor


# The ten steps of a block: (name, kind, the module that runs it; None: a residual add, no module of its own)
BLOCK_STEPS = (("LayerNorm 1", "per token", "ln_1"), ("QKV proj", "linear", "attn.qkv"),
               ("attention", "attention", "attn.core"), ("out proj", "linear", "attn.out_proj"),
               ("residual add 1", "per token", None), ("LayerNorm 2", "per token", "ln_2"),
               ("FFN-up", "linear", "mlp.fc_up"), ("GeLU", "per token", "mlp.act"),
               ("FFN-down", "linear", "mlp.fc_down"), ("residual add 2", "per token", None))
# what the step after each one reads, in the block's own forward: its input ("in") or its output ("out")
_READ = {"ln_1": ("attn.qkv", "in"), "attn.qkv": ("attn.qkv", "out"), "attn.core": ("attn.out_proj", "in"),
         "attn.out_proj": ("attn.out_proj", "out"), "ln_2": ("mlp.fc_up", "in"), "mlp.fc_up": ("mlp.fc_up", "out"),
         "mlp.act": ("mlp.fc_down", "in"), "mlp.fc_down": ("mlp.fc_down", "out")}


@torch.no_grad()
def block_steps(model, x: Tensor, seq_lens: Sequence[int], backend: str = "loop") -> list[BlockStep]:
    """The ten steps (``BLOCK_STEPS``) of the first block of ``model`` (a ``Transformer``) on the flat rows ``x [T, d]``.

    One real ``block(x)`` (varlen causal attention, ``backend``) runs under forward hooks
    (``measure.recorder.module_io``), so ``Block.forward`` decides every value: each step's output is what the
    next step read (the residual sums: ``ln_2``'s input, the block's output), the last one ``block(x)`` bit for
    bit. ``fn`` is the step's module alone; a residual add has no module, so its ``fn`` is ``block_sum`` with the
    added module's output replaced by ``t`` (the out proj's, for the second add, by the flat run's rows).
    ``fn64``: the same on the model's float64 twin. ValueError if ``x``'s rows do not add up to ``seq_lens``.
    """
    lens = check_lengths(seq_lens)
    cu = cumulative(lens)
    if x.shape[0] != cu[-1]:
        raise ValueError(f"x has {x.shape[0]} rows, seq_lens add up to {cu[-1]}")
    twin, whole = float64_twin(model), slice(None)

    def context(m, rows, run):
        with attention_context(m, _cu_of(cu, rows), backend, x.device):
            return run()

    paths = sorted({reader for reader, _ in _READ.values()} | {"ln_2", ""})  # the modules whose inputs/outputs we read
    block = model.layers[0]
    io = context(model, whole, lambda: module_io(block, paths, lambda: block(x)))
    missing = [p for p in paths if p not in io]
    if missing:
        raise RuntimeError(f"Block.forward did not run {missing}: block_steps reads the steps off those modules")

    def fn_of(m, path):
        step = module_step(m, path, backend)
        return lambda t, rows=whole: step(t, _cu_of(cu, rows))

    def residual(m, inject, read):  # the block's own add: the block on its rows, the added module's output is t
        def fn(t, rows=whole):
            outputs = {"attn.out_proj": io["attn.out_proj"][1][rows].to(t.dtype), inject: t}
            return context(m, rows, lambda: block_sum(m.layers[0], x[rows].to(t.dtype), outputs, read))
        return fn

    # (module whose output the add adds, where its sum is read, the sum in the whole forward) of the two residual adds
    residuals = iter([("attn.out_proj", "ln_2", io["ln_2"][0][0]), ("mlp.fc_down", "", io[""][1])])
    steps: list[BlockStep] = []
    inp = x
    for name, kind, path in BLOCK_STEPS:
        if path is None:
            inject, read, out = next(residuals)
            fn, fn64 = residual(model, inject, read), residual(twin, inject, read)
        else:
            fn, fn64 = fn_of(model, path), fn_of(twin, path)
            reader, side = _READ[path]
            out = io[reader][0][0] if side == "in" else io[reader][1]
        steps.append(BlockStep(name, kind, fn, fn64, inp, out))
        inp = out
    return steps


@dataclass(frozen=True)
class StepReport:
    """What ``step_report`` found for one step (all measured, nothing drawn by hand)."""

    name: str
    kind: str
    shape_in: tuple
    shape_out: tuple
    off_diagonal: int        # pairs (i, j != i): changing input row j changed output row i (bitwise)
    cross_request: int       # of those, pairs where i and j belong to different requests
    reads: str               # which rows row i reads (``reach_counts``)
    err: float               # max |flat - fp64 alone| over every request's rows
    bound: float             # the tolerance rule's bound for it (2·|alone - fp64| + 2 eps · scale)
    flat_vs_alone: float     # max |flat - alone| (both float32)
    differ_per_request: tuple  # per request: its output numbers that differ in any bit, flat vs alone
    padded_differ: int       # the first request alone but padded with zero rows to T rows: its numbers that differ
    scale: float             # max |output| of the flat run: the scale the rounding is measured at


@torch.no_grad()
def step_report(step: BlockStep, seq_lens: Sequence[int], dep: np.ndarray) -> StepReport:
    """``step`` (a ``BlockStep`` on the flat rows of ``seq_lens``) with ``dep``, its measured bool ``[T, T]`` map
    (``course.probe.row_dependency(step.fn, step.inp)``): every request run alone against the flat run (float32)
    and against the float64 twin alone (the tolerance rule), and request 0 alone padded with zero rows to T."""
    lens = check_lengths(seq_lens)
    cu = cumulative(lens)
    spans = list(zip(cu[:-1], cu[1:]))
    seen = reach_counts(dep, lens)
    alone = torch.cat([step.fn(step.inp[s:e], slice(s, e)) for s, e in spans])
    alone64 = torch.cat([step.fn64(step.inp[s:e].double(), slice(s, e)) for s, e in spans])
    padded = torch.zeros_like(step.inp)  # request 0's rows, then zero rows: the flat batch's shape, no B in it
    padded[:lens[0]] = step.inp[:lens[0]]
    return StepReport(step.name, step.kind, tuple(step.inp.shape), tuple(step.out.shape),
                      seen["own_request"] + seen["other_requests"], seen["other_requests"], seen["reads"],
                      max_abs_diff(step.out, alone64), tolerance(alone, alone64), max_abs_diff(step.out, alone),
                      tuple(int((step.out[s:e] != alone[s:e]).sum()) for s, e in spans),
                      int((step.fn(padded)[:lens[0]] != step.out[:lens[0]]).sum()), float(step.out.abs().max()))


@torch.no_grad()
def rows_alone_bits(fn: Callable[[Tensor], Tensor], x: Tensor, counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """For each ``m`` in ``counts``: run the first ``m`` rows of ``x`` alone through ``fn`` and count the
    output numbers that differ in any bit from the same rows of ``fn(x)``. Returns ``[(m, differ, of)]``.

    Which shapes share a kernel path is the math library's choice: an observation of this machine, to
    print, never to assert (both results are within rounding of the exact value)."""
    full = fn(x)
    out = []
    for m in counts:
        m = check_int("m", m, minimum=1, maximum=x.shape[0])
        alone = fn(x[:m])
        out.append((m, int((alone != full[:m]).sum()), alone.numel()))
    return out


@dataclass(frozen=True)
class WalkStep:
    """One step of the forward on the flat batch: its shapes and which rows it lets row i read."""

    name: str
    kind: str          # "per token", "linear" or "attention" (the colour of the figure)
    flat: str          # shape on the flat batch at TP=1, e.g. "[40 x 512] -> [40 x 1536]"
    per_rank: str      # the same on one rank at TP=tp_size
    reads: str         # "row i only" or "rows ≤ i of its own request"


def forward_walk(cfg: ModelConfig, seq_lens: Sequence[int], tp_size: int = 2) -> list[WalkStep]:
    """The embedding and the ten steps of a pre-LN block on the ``T = sum(seq_lens)`` flat rows, the four
    linear layers' shapes from the engine's cut (``measure.flops.linear_shapes``, at TP=1 and on one rank of
    ``tp_size``); attention as the block calls it, the fused QKV output in, the out proj's input out."""
    t, d = sum(check_lengths(seq_lens)), cfg.d_model
    (qkv, out, up, down), (qkv_r, out_r, up_r, down_r) = linear_shapes(cfg), linear_shapes(cfg, tp_size)

    def arrow(a: int, b: int, all_reduce: bool = False) -> str:
        return f"[{t} x {a}] -> [{t} x {b}]" + (" + all-reduce" if all_reduce else "")

    embed = f"[{t}] ids -> [{t} x {d}]"
    own, itself = "rows ≤ i of its own request", "row i only"
    return [
        WalkStep("embed (token + position)", "per token", embed, embed, itself),
        WalkStep("LayerNorm", "per token", arrow(d, d), arrow(d, d), itself),
        WalkStep("QKV proj", "linear", arrow(*qkv), arrow(*qkv_r), itself),
        WalkStep("attention", "attention", arrow(qkv[1], out[0]), arrow(qkv_r[1], out_r[0]), own),
        WalkStep("out proj", "linear", arrow(*out), arrow(*out_r, all_reduce=True), itself),
        WalkStep("residual add", "per token", arrow(d, d), arrow(d, d), itself),
        WalkStep("LayerNorm", "per token", arrow(d, d), arrow(d, d), itself),
        WalkStep("FFN-up", "linear", arrow(*up), arrow(*up_r), itself),
        WalkStep("GeLU", "per token", arrow(up[1], up[1]), arrow(up_r[1], up_r[1]), itself),
        WalkStep("FFN-down", "linear", arrow(*down), arrow(*down_r, all_reduce=True), itself),
        WalkStep("residual add", "per token", arrow(d, d), arrow(d, d), itself),
    ]


def format_reports(reports: Sequence[StepReport]) -> str:
    """One line per step: shapes and who row i reads (counts only: stable across machines)."""
    lines = [f"{'step':15s} {'input':>14s} {'output':>14s}  row i reads"]
    for r in reports:
        shape_in, shape_out = (" x ".join(map(str, s)) for s in (r.shape_in, r.shape_out))
        lines.append(f"{r.name:15s} {'[' + shape_in + ']':>14s} {'[' + shape_out + ']':>14s}  {r.reads}")
    return "\n".join(lines)


def rounding_lines(reports: Sequence[StepReport], seq_lens: Sequence[int]) -> str:
    """Per step of ``reports`` (on the flat rows of ``seq_lens``): how many of each request's output numbers
    differ (in any bit) flat vs alone, the same for request 0 alone padded with zero rows to the flat batch's row
    count, max |flat - alone| (also in float32 ULPs of the step's largest output number, ``ulp32(max|y|)``) and
    both against float64 (machine-dependent: shown, not asserted)."""
    lens = check_lengths(seq_lens)
    t = sum(lens)
    names = [request_name(i) for i in range(len(lens))]
    heads = [f"{n}: numbers differ" for n in names] + [f"{names[0]} padded to {t}"]
    lines = [f"{'step':15s} " + " ".join(f"{h:>18s}" for h in heads)
             + f" {'max|flat-alone|':>16s} {'ULPs of max|y|':>16s} {'max|flat-fp64|':>15s} {'bound':>9s}"]
    for r in reports:
        per_row = int(np.prod(r.shape_out)) // t
        cells = [f"{d} of {n * per_row}" for d, n in zip(r.differ_per_request, lens)]
        cells.append(f"{r.padded_differ} of {lens[0] * per_row}")
        ulp = r.flat_vs_alone / ulp32(r.scale) if r.scale else 0.0
        lines.append(f"{r.name:15s} " + " ".join(f"{c:>18s}" for c in cells)
                     + f" {r.flat_vs_alone:16.1e} {ulp:16.1f} {r.err:15.1e} {r.bound:9.1e}")
    return "\n".join(lines)


def rows_alone_lines(rows: Sequence[tuple[int, int, int]], name: str = "QKV proj") -> str:
    """``rows_alone_bits`` as one line per row count (``QKV proj on rows 0..m-1 alone: d of n numbers differ``),
    then which row counts gave other bits than the flat run and which gave its bits."""
    lines = [f"{name} on the first {m:2d} rows alone, [{m} x k]: {d:5d} of {n:5d} numbers differ from the flat run"
             for m, d, n in rows]
    other, same = ([m for m, d, _ in rows if (d > 0) == differ] for differ in (True, False))
    return "\n".join(lines + [f"row counts that gave other bits: {other or 'none'}; the flat run's bits: {same or 'none'}"])
