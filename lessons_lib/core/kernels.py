"""Which attention kernels run here, decided from facts, with the reason for every refusal.

The pure-PyTorch backends run anywhere. Each optional kernel states what it needs and
``available_backends`` checks it: the import; the device; a GPU's compute capability
(FlashAttention 2 and PyTorch's varlen kernel need sm80+: A100, H100, H200, not a T4); half
precision; a head dim ≤ 256 and a multiple of 8. PyTorch renamed ``varlen_attn``'s causal switch
(``is_causal`` → ``window_size``): the call is built from its signature, not a version string.
The course's own Triton kernel (``triton``, lesson 07) runs on CUDA and, through Triton's
interpreter, on the CPU (slow: opt-in); ``auto`` does not take it until a GPU run has timed it
against the others (``tools/gpu_check.py``). ``auto``: on CUDA flash → torch_varlen → sdpa; on the
CPU sdpa. ``placement``: CUDA + bfloat16 with a GPU, else CPU + float32; explicit arguments win.
A test swaps a kernel for a contract double by replacing its ``KERNELS`` entry.

Taught in notebooks/00_setup_one_request.ipynb, notebooks/03_masked_vs_varlen_attention.ipynb and
notebooks/07_inside_the_kernel.ipynb.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..validate import dtype_name

BACKENDS = ("loop", "masked", "padded", "sdpa", "flex", "flash", "torch_varlen", "triton")
PURE = ("loop", "masked", "padded", "sdpa")
AUTO_ORDER = {"cuda": ("flash", "torch_varlen", "sdpa"), "cpu": ("sdpa",)}
HALF = (torch.float16, torch.bfloat16)


class BackendStatus(NamedTuple):
    available: bool
    reason: str


@functools.cache
def _import(module: str, names: tuple) -> tuple:
    """``(object, "present")`` (a tuple of objects for several names), or ``(None, why not)``."""
    if not torch.cuda.is_available():  # Triton, imported by some of these, can only interpret here: say so first
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        found = tuple(getattr(importlib.import_module(module), n) for n in names)
    except Exception as exc:  # ImportError, or a CUDA library missing at import
        return None, f"{module} not importable here ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
    return (found if len(found) > 1 else found[0]), f"{module} present"


@dataclass(frozen=True)
class Kernel:
    """An optional kernel (``names`` in ``module``) and what it needs to run."""

    module: str
    names: tuple
    devices: tuple = ("cuda",)
    dtypes: tuple | None = HALF
    cpu_dtypes: tuple | None = None  # where the CPU takes others (Triton's interpreter: float32 too)
    min_capability: tuple = (8, 0)
    max_head_dim: int = 256
    head_dim_multiple: int = 8

    def load(self) -> tuple:
        return _import(self.module, self.names)


KERNELS = {"flex": Kernel("torch.nn.attention.flex_attention", ("flex_attention", "create_block_mask"),
                          devices=("cpu", "cuda"), dtypes=None, min_capability=(0, 0), max_head_dim=1 << 30,
                          head_dim_multiple=1),
           "flash": Kernel("flash_attn", ("flash_attn_varlen_func",)),
           "torch_varlen": Kernel("torch.nn.attention.varlen", ("varlen_attn",)),
           # The course's own Triton kernel: native on CUDA (fp16/bf16, sm80+: its tile table's GPUs, as FlashAttention),
           # Triton's interpreter on the CPU (slow: opt-in only; float32 too).
           "triton": Kernel("lessons_lib.ops.triton_varlen", ("varlen_fwd",), devices=("cpu", "cuda"),
                            cpu_dtypes=(torch.float32, *HALF), head_dim_multiple=1)}


def placement(device=None, dtype: torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)``: given values win; else CUDA + bfloat16 with a GPU, CPU + float32 without."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): timings must include the kernels."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _refusal(k: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    if device.type not in k.devices:
        return f"{'/'.join(k.devices).replace('cuda', 'CUDA')} only (device is {device.type})"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA not available"
        cc, need = torch.cuda.get_device_capability(device), k.min_capability
        if cc < need:
            return f"needs compute capability >= sm{need[0]}{need[1]}, this GPU is sm{cc[0]}{cc[1]}"
    dtypes = k.cpu_dtypes if device.type == "cpu" and k.cpu_dtypes is not None else k.dtypes
    if dtypes is not None and dtype not in dtypes:
        return f"needs {'/'.join(dtype_name(d) for d in dtypes)}, got {dtype_name(dtype)}"
    if head_dim is not None and (head_dim > k.max_head_dim or head_dim % k.head_dim_multiple):
        return f"head dim {head_dim} unsupported (at most {k.max_head_dim}, a multiple of {k.head_dim_multiple})"
    return None


def available_backends(device="cpu", dtype: torch.dtype = torch.float32,
                       head_dim: int | None = None) -> dict[str, BackendStatus]:
    """Every backend: does it run for ``device``, ``dtype`` and ``head_dim`` here, and why (not)."""
    out = {name: BackendStatus(True, "pure PyTorch, any device") for name in PURE}
    for name, k in KERNELS.items():
        fn, why = k.load()
        refusal = None if fn is None else _refusal(k, torch.device(device), dtype, head_dim)
        out[name] = BackendStatus(fn is not None and refusal is None, refusal or why)
    return out


def resolve_backend(backend, device="cpu", dtype: torch.dtype = torch.float32, head_dim: int | None = None):
    """``"auto"`` → the first available of ``AUTO_ORDER``; a named backend → itself if it runs here;
    your own function (see ``attention``) → itself."""
    if callable(backend) or backend in PURE:
        return backend
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    status = available_backends(device, dtype, head_dim)
    if backend == "auto":
        order = AUTO_ORDER["cuda" if torch.device(device).type == "cuda" else "cpu"]
        return next(b for b in order if status[b].available)
    if not status[backend].available:
        raise RuntimeError(f"attention backend {backend!r} is not available here: {status[backend].reason}")
    return backend


def kernel(name: str):
    """The loaded function of an optional kernel (``resolve_backend`` has checked that it runs)."""
    return KERNELS[name].load()[0]


@functools.cache
def torch_varlen_kwargs(fn, causal: bool, scale: float, gqa: bool = False) -> dict:
    """Keyword arguments for PyTorch's ``varlen_attn``, built from its signature (cached: never mutate the result).
    ``gqa``: K/V have fewer heads than Q, passed as ``enable_gqa`` where the signature has it."""
    params = inspect.signature(fn).parameters
    kw = {"scale": scale} if "scale" in params else {}
    kw |= {"enable_gqa": True} if gqa and "enable_gqa" in params else {}
    if "is_causal" in params:
        return kw | {"is_causal": causal}
    if "window_size" in params:  # (-1, 0): every key up to the diagonal, bottom-right aligned
        return kw | {"window_size": (-1, 0) if causal else (-1, -1)}
    raise RuntimeError(f"varlen_attn{inspect.signature(fn)} has neither is_causal nor window_size")
