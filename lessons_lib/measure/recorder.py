"""The op recorder: what a call really ran, op by op, on any backend.

``OpRecorder`` is a ``TorchDispatchMode``: every ATen op (and custom op) that reaches the
dispatcher inside ``with OpRecorder() as rec:`` is run and recorded as an ``Op`` (its name and
the shapes it read and wrote). From that one record it derives what the lessons count:

  matmuls   every matrix multiply as a ``Matmul`` (batch, m, k, n): FLOPs, bytes, intensity
  scores    the score matrices attention computed, ``(..., L_q, L_k)``: one per softmax over
            scores, one per request block of a fused attention kernel (masked cells count,
            they were computed)
  cells     the score cells of all of them, every head included
  linear_rows  the rows every linear layer ran on (one ``m`` for all of them)
  flops_by_kind  the matmuls' FLOPs, {"linear", "attention"}
  outputs   (op name, shape) of every tensor any op created, temporaries included

The op names live in one table each: ``MATMUL_OPS``, ``SOFTMAX_OPS``, ``FUSED_ATTENTION_OPS``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BF16 = 2  # bytes per element of the dtype the engine is served in

# name -> (positions of the [.., m, k] and [.., k, n] operands); a linear layer's weight is the second
MATMUL_OPS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "addbmm": (1, 2),
              "mv": (0, 1), "dot": (0, 1)}
SOFTMAX_OPS = ("_softmax", "_safe_softmax", "softmax")
# name -> (layout of q, k, v; argument positions of cu_seqlens_q and cu_seqlens_k, or None)
#   "bhld": [batch, heads, L, d] (the SDPA kernels)   "blhd": [batch, L, heads, d], [T, heads, d] with cu_seqlens
FUSED_ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": ("bhld", None),
    "_scaled_dot_product_flash_attention": ("bhld", None),
    "_scaled_dot_product_efficient_attention": ("bhld", None),
    "_scaled_dot_product_cudnn_attention": ("bhld", None),
    "_scaled_dot_product_fused_attention_overrideable": ("bhld", None),
    "_flash_attention_forward": ("blhd", (3, 4)),
    "_efficient_attention_forward": ("blhd", (4, 5)),
    "_varlen_attn": ("blhd", (3, 4)),                 # torch.nn.attention.varlen.varlen_attn
    "_flash_attn_varlen_forward": ("blhd", (3, 4)),   # the flash-attn package
}


@dataclass(frozen=True)
class Matmul:
    """One executed matrix multiply ``[batch, m, k] @ [batch, k, n]`` (batch = 1 for a plain mm).

    kind: "linear" (``mm``/``addmm``: a linear layer, the weight is the ``[k, n]`` operand) or
    "attention" (``bmm``, per head, or one side, Q K^T or P V, of a fused attention kernel).
    """

    kind: str
    batch: int
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    def bytes(self, nbytes: int = BF16) -> int:
        """Both operands read once and the output written once: ``nbytes · batch · (mk + kn + mn)``."""
        return nbytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)

    def intensity(self, nbytes: int = BF16) -> float:
        return self.flops / self.bytes(nbytes)


@dataclass(frozen=True)
class Op:
    """One op that ran: its name (``func.overloadpacket.__name__``), what it read, what it wrote.

    ``args`` keeps the tensors' shapes (and the values of the small index tensors: cu_seqlens)
    in place of the tensors, and every other argument as it was."""

    name: str
    args: tuple
    outputs: tuple


@dataclass(frozen=True)
class _Tensor:
    shape: tuple
    values: tuple | None  # the values of a 1-d integer tensor (cu_seqlens), else None


def _describe(x):
    if not isinstance(x, torch.Tensor):
        return x
    small_index = x.dim() == 1 and not x.is_floating_point() and x.numel() <= 4097
    return _Tensor(tuple(x.shape), tuple(x.tolist()) if small_index else None)


def _matmul(op: Op) -> Matmul:
    a, b = (op.args[i].shape for i in MATMUL_OPS[op.name])
    if len(a) == 3:                                            # bmm / baddbmm / addbmm: per head
        return Matmul("attention", a[0], a[1], a[2], b[2])
    m, k = (1, a[0]) if len(a) == 1 else a
    n = 1 if len(b) == 1 else b[-1]
    return Matmul("linear", 1, m, k, n)


def fused_attention_blocks(op: Op) -> list[tuple[int, int, int, int]]:
    """``(heads x batch, L_q, L_k, d)`` of each score block the recorded fused attention ``op`` (one of
    ``FUSED_ATTENTION_OPS``) computed: one block per request of a varlen call (read from its ``cu_seqlens``)."""
    layout, cu_args = FUSED_ATTENTION_OPS[op.name]
    q, k = op.args[0].shape, op.args[1].shape
    if layout == "bhld":
        return [(q[0] * q[1], q[2], k[2], q[3])]
    cu_q, cu_k = (op.args[i] if cu_args else None for i in (cu_args or (0, 0)))
    if cu_q is None or cu_q.values is None:                   # [batch, L, heads, d]
        return [(q[0] * q[2], q[1], k[1], q[3])]
    starts_q, starts_k = cu_q.values, (cu_k.values if cu_k is not None and cu_k.values else cu_q.values)
    heads = q[-2]
    return [(heads, starts_q[i + 1] - starts_q[i], starts_k[i + 1] - starts_k[i], q[-1])
            for i in range(len(starts_q) - 1)]


def is_view_op(name: str) -> bool:
    """Whether the aten op ``name`` (as ``OpRecorder`` records it) returns a view of an argument (its schema's
    ``OpOverload.is_view``), or is ``_unsafe_view`` (a reshape whose schema does not say it aliases): a view launches
    no kernel. ValueError for a name that is not an aten op."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "overloads"):
        raise ValueError(f"{name!r} is not an aten op")
    return name == "_unsafe_view" or getattr(packet, packet.overloads()[0]).is_view


class OpRecorder(TorchDispatchMode):
    """Run and record every op of the block: ``with OpRecorder() as rec: ...`` (see the module)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __enter__(self):
        super().__enter__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_out = tuple(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops.append(Op(func.overloadpacket.__name__, tuple(_describe(a) for a in args), flat_out))
        return out

    def named(self, *names: str) -> list[Op]:
        return [op for op in self.ops if op.name in names]

    def launched(self) -> list[str]:
        """The names of the recorded ops that are not views (``is_view_op``), in order: on a GPU each launches a
        kernel (or, ``_local_scalar_dense``, reads a value back to the host), one after the other."""
        return [op.name for op in self.ops if not is_view_op(op.name)]

    @property
    def matmuls(self) -> list[Matmul]:
        """Every matrix multiply, in order; a fused attention block counts as its Q K^T and P V."""
        found = []
        for op in self.ops:
            if op.name in MATMUL_OPS:
                found.append(_matmul(op))
            elif op.name in FUSED_ATTENTION_OPS:
                for b, lq, lk, d in fused_attention_blocks(op):
                    found += [Matmul("attention", b, lq, d, lk), Matmul("attention", b, lq, lk, d)]
        return found

    @property
    def scores(self) -> list[tuple]:
        """The shape of each score matrix computed: ``(..., L_q, L_k)``, heads in the leading dims."""
        found = []
        for op in self.ops:
            if op.name in SOFTMAX_OPS:
                found.append(op.args[0].shape)
            elif op.name in FUSED_ATTENTION_OPS:
                found += [(b, lq, lk) for b, lq, lk, _ in fused_attention_blocks(op)]
        return found

    @property
    def cells(self) -> int:
        """Score cells computed, all heads together (divide by the head count for per head)."""
        return sum(math.prod(s) for s in self.scores)

    def score_counts(self, n_heads: int, n_layers: int, wider_than: int = 0) -> dict[str, int]:
        """Per head per layer, summed over ``scores`` (every sequence of a call counted): ``cells`` (``L_q × L_k``),
        ``query_rows`` (``L_q``), ``cached_rows`` (``L_k - L_q``: keys beyond a block's own queries) and
        ``cells_wider`` (cells of the blocks with more than ``wider_than`` keys). ValueError if a sum is not a
        multiple of ``n_heads × n_layers`` (the recording is not of that model)."""
        sums = dict.fromkeys(("cells", "query_rows", "cached_rows", "cells_wider"), 0)
        for shape in self.scores:
            seqs, (q, k) = math.prod(shape[:-2]), shape[-2:]
            for name, n in (("cells", q * k), ("query_rows", q), ("cached_rows", k - q),
                            ("cells_wider", q * k * (k > wider_than))):
                sums[name] += seqs * n
        per = n_heads * n_layers
        odd = {name: n for name, n in sums.items() if n % per}
        if odd:
            raise ValueError(f"recorded {odd}: not a multiple of {n_heads} heads x {n_layers} layers")
        return {name: n // per for name, n in sums.items()}

    @property
    def linear_rows(self) -> int:
        """The rows (``m``) every linear layer ran on; ValueError if the layers ran on different row counts."""
        rows = {m.m for m in self.matmuls if m.kind == "linear"}
        if len(rows) != 1:
            raise ValueError(f"expected one row count for every linear layer, got {sorted(rows)}")
        return rows.pop()

    @property
    def flops_by_kind(self) -> dict[str, int]:
        """FLOPs of the recorded matmuls: ``{"linear": ..., "attention": ...}``."""
        return {kind: sum(m.flops for m in self.matmuls if m.kind == kind) for kind in ("linear", "attention")}

    @property
    def outputs(self) -> list[tuple[str, tuple]]:
        """(op name, shape) of every tensor created, in order."""
        return [(op.name, shape) for op in self.ops for shape in op.outputs]


def record_ops(fn: Callable[[], object]) -> OpRecorder:
    """Run ``fn()`` under an ``OpRecorder`` and return the recorder."""
    with OpRecorder() as rec:
        fn()
    return rec


def record_matmuls(fn: Callable[[], object]) -> list[Matmul]:
    """Every matrix multiply ``fn()`` executes, in order (see ``Matmul``). Attention by the
    "loop" and "masked" backends shows up as one ``bmm`` pair per request (or per batch);
    fused kernels (SDPA, varlen) as one pair per score block."""
    return record_ops(fn).matmuls


def module_io(root: torch.nn.Module, paths: Sequence[str], fn: Callable[[], object]) -> dict[str, tuple[tuple, object]]:
    """Run ``fn()`` with a forward hook on each ``root.get_submodule(path)`` (``""``: ``root`` itself)
    and return ``{path: (inputs, output)}`` of its last call: what the model's own modules read
    and wrote, positional inputs as a tuple. A module that did not run is missing."""
    seen: dict[str, tuple[tuple, object]] = {}

    def hook(path):
        def remember(_module, args, out) -> None:  # returns None: the output is left as it is
            seen[path] = (tuple(args), out)
        return remember
    handles = [root.get_submodule(p).register_forward_hook(hook(p)) for p in paths]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return seen


BLOCK_PARTS = ("ln_1", "attn.qkv", "attn.core", "attn.out_proj", "ln_2", "mlp.fc_up", "mlp.act", "mlp.fc_down")


def follow_request(model: torch.nn.Module, batch) -> tuple[list, list, torch.Tensor]:
    """``model(batch)`` (a ``core.model.Transformer``) watched by ``module_io``: ``(calls, block_outputs, hidden)``,
    where ``calls`` are ``(part, output shape)`` of block 0's ``BLOCK_PARTS`` in the order they first ran,
    ``block_outputs`` the output shape of every block that ran, ``hidden`` the model's output ``[T, d_model]``."""
    blocks = [f"layers.{i}" for i in range(len(model.layers))]
    seen = module_io(model, [f"layers.0.{p}" for p in BLOCK_PARTS] + blocks + [""], lambda: model(batch))
    calls = [(path.removeprefix("layers.0."), list(out.shape)) for path, (_, out) in seen.items()
             if path.startswith("layers.0.")]
    return calls, [list(seen[b][1].shape) for b in blocks if b in seen], seen[""][1]
