"""Shared test fixtures: a tiny model config, random flat q/k/v, and the tolerance rule."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `pytest` without `python -m` finds lessons_lib

from lessons_lib import ModelConfig, Transformer, init_weights
from lessons_lib.core.batch import seq_lens_to_cu_seqlens
from lessons_lib.measure.tolerance import tolerance


@pytest.fixture(scope="session")
def rule_bound():
    """The one tolerance rule (lessons_lib.measure.tolerance): ``rule_bound(ref, ref64)`` is the
    largest |out - ref64| allowed for an ``out`` computed in ref's dtype."""
    return tolerance


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    """2 layers, d_model 64, 4 heads of 16: the article's shape of model, small enough for many examples."""
    return ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300,
                       max_position=256, tp_size=2)


def _make_qkv(lens_q, lens_k=None, heads=2, d_head=32, seed=0, dtype=torch.float32, device="cpu"):
    """Random flat ``q [T_q, H, D]``, ``k, v [T_k, H, D]`` and int32 ``cu_seqlens_q, cu_seqlens_k``."""
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, d_head, generator=g)
    k, v = (torch.randn(sum(lens_k), heads, d_head, generator=g) for _ in range(2))
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, seq_lens_to_cu_seqlens(lens_q, device), seq_lens_to_cu_seqlens(lens_k, device)


@pytest.fixture(scope="session")
def make_qkv():
    return _make_qkv


def _model_pair(cfg: ModelConfig, seed: int = 0) -> tuple[Transformer, Transformer]:
    """The fp32 model and its float64 twin (the same fp32 weight values, upcast): the exact-math yardstick."""
    w = init_weights(cfg, seed)
    cfg64 = ModelConfig(**{f: getattr(cfg, f) for f in cfg.__slots__ if f != "dtype"}, dtype=torch.float64)
    return Transformer(cfg, w), Transformer(cfg64, {k: t.double() for k, t in w.items()})


def _make_requests(lens, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Random token-id tensors ``[L_i]`` in ``[0, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@pytest.fixture(scope="session")
def model_pair():
    return _model_pair


@pytest.fixture(scope="session")
def make_requests():
    return _make_requests
