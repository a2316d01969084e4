"""Which attention kernels run here, decided from facts, with the reason for every refusal.

Pure-PyTorch backends (``loop``, ``masked``, ``padded``, ``sdpa``) run anywhere. The optional
kernels each state what they need, and ``available_backends`` checks it against this
machine: the kernel imports; the device type; a GPU's compute capability (FlashAttention 2
and PyTorch's varlen kernel need sm80+: an A100, H100 or H200, not a T4); the dtype (half
precision only); the head dim (≤ 256, a multiple of 8). PyTorch renamed the causal switch of
``varlen_attn`` across releases (``is_causal`` → ``window_size``), so the call is built from
the function's signature, never from a version string.

``auto`` takes, in order: on CUDA flash → torch_varlen → sdpa; on the CPU sdpa.
``placement`` gives the engine's defaults: CUDA in bfloat16 when a GPU is present, else the
CPU in float32; explicit arguments win.

A test swaps a kernel for a contract double (same signature and preconditions, computed with
the reference) by replacing its ``KERNELS`` entry (see ``LESSONS_TEST_HOOK`` in ``core``).

Taught in notebooks/00_setup_one_request.ipynb and notebooks/03_masked_vs_varlen_attention.ipynb.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .validate import dtype_name

BACKENDS = ("loop", "masked", "padded", "sdpa", "flex", "flash", "torch_varlen")
PURE = ("loop", "masked", "padded", "sdpa")
AUTO_ORDER = {"cuda": ("flash", "torch_varlen", "sdpa"), "cpu": ("sdpa",)}
HALF = (torch.float16, torch.bfloat16)


class BackendStatus(NamedTuple):
    available: bool
    reason: str


@functools.cache
def _load_flash():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a CUDA library missing at import
        return None, (f"flash-attn not importable ({type(exc).__name__}); on a CUDA machine: "
                      "pip install -r requirements-gpu.txt --no-build-isolation")
    return flash_attn_varlen_func, "flash-attn installed"


@functools.cache
def _load_torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        return None, f"torch.nn.attention.varlen not in torch {torch.__version__} ({type(exc).__name__})"
    return varlen_attn, "torch.nn.attention.varlen.varlen_attn present"


@functools.cache
def _load_flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as exc:
        return None, f"FlexAttention not in torch {torch.__version__} ({type(exc).__name__})"
    return (flex_attention, create_block_mask), "FlexAttention present (eager: correct, slow; a teaching backend)"


@dataclass(frozen=True)
class Kernel:
    """An optional kernel and what it needs. ``load()`` → ``(function or None, reason)``."""

    load: Callable[[], tuple]
    devices: tuple = ("cuda",)
    dtypes: tuple | None = HALF
    min_capability: tuple = (8, 0)
    max_head_dim: int = 256


KERNELS = {"flex": Kernel(_load_flex, devices=("cpu", "cuda"), dtypes=None, min_capability=(0, 0), max_head_dim=1 << 30),
           "flash": Kernel(_load_flash), "torch_varlen": Kernel(_load_torch_varlen)}


def placement(device=None, dtype: torch.dtype | None = None) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)``: given values win; else CUDA + bfloat16 with a GPU, CPU + float32 without."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): timings must include the kernels."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _refusal(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    if device.type not in kernel.devices:
        return f"{'/'.join(d.upper() if d == 'cuda' else d for d in kernel.devices)} only (device is {device.type})"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA not available"
        cc = torch.cuda.get_device_capability(device)
        if cc < kernel.min_capability:
            return (f"needs compute capability >= {kernel.min_capability[0]}.{kernel.min_capability[1]} "
                    f"(sm{kernel.min_capability[0]}{kernel.min_capability[1]}), this GPU is sm{cc[0]}{cc[1]}")
    if kernel.dtypes is not None and dtype not in kernel.dtypes:
        return f"needs {'/'.join(dtype_name(d) for d in kernel.dtypes)}, got {dtype_name(dtype)}"
    if head_dim is not None and (head_dim > kernel.max_head_dim or (kernel.dtypes and head_dim % 8)):
        return f"head dim {head_dim} unsupported (at most {kernel.max_head_dim}, a multiple of 8)"
    return None


def available_backends(device="cpu", dtype: torch.dtype = torch.float32,
                       head_dim: int | None = None) -> dict[str, BackendStatus]:
    """Every backend: does it run for ``device``, ``dtype`` and ``head_dim`` here, and why (not)."""
    device = torch.device(device)
    out = {name: BackendStatus(True, "pure PyTorch, any device") for name in ("loop", "masked", "padded")}
    out["sdpa"] = BackendStatus(True, "F.scaled_dot_product_attention, requests of equal length batched")
    for name, kernel in KERNELS.items():
        fn, why = kernel.load()
        refusal = "" if fn is None else _refusal(kernel, device, dtype, head_dim)
        out[name] = BackendStatus(fn is not None and refusal is None, refusal or why)
    return out


def resolve_backend(backend: str, device="cpu", dtype: torch.dtype = torch.float32, head_dim: int | None = None) -> str:
    """``"auto"`` → the first available of ``AUTO_ORDER``; a named backend → itself, if it runs here;
    your own function (see ``attention``) → itself."""
    if callable(backend):
        return backend
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    if backend in PURE:
        return backend
    status = available_backends(device, dtype, head_dim)
    if backend == "auto":
        order = AUTO_ORDER["cuda" if torch.device(device).type == "cuda" else "cpu"]
        return next(b for b in order if status[b].available)
    if not status[backend].available:
        raise RuntimeError(f"attention backend {backend!r} is not available here: {status[backend].reason}")
    return backend


def kernel(name: str):
    """The loaded function of an optional kernel (``resolve_backend`` has checked it exists)."""
    return KERNELS[name].load()[0]


@functools.cache
def torch_varlen_kwargs(fn, causal: bool, scale: float) -> dict:
    """Keyword arguments for PyTorch's ``varlen_attn``, built from its signature."""
    params = inspect.signature(fn).parameters
    kw = {"scale": scale} if "scale" in params else {}
    if "is_causal" in params:
        return kw | {"is_causal": causal}
    if "window_size" in params:  # (-1, 0): every key up to the diagonal, bottom-right aligned
        return kw | {"window_size": (-1, 0) if causal else (-1, -1)}
    raise RuntimeError(f"varlen_attn{inspect.signature(fn)} has neither is_causal nor window_size")
