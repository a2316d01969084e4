"""Shared test fixtures: a tiny model config, random flat q/k/v, a model and its float64 twin, random requests."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `pytest` without `python -m` finds lessons_lib

from helpers import make_qkv as _make_qkv

from lessons_lib import ModelConfig, Transformer, init_weights
from lessons_lib.measure.tolerance import float64_twin
from lessons_lib.serve import workloads
from lessons_lib.tp.workers import threads_per_worker


# ---- --device: the tests marked `device` (tests/test_device.py) run there; tools/gpu_check.py runs them
def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="where the tests marked 'device' run (default cpu): pytest -m device --device cuda")


def pytest_configure(config):
    config.addinivalue_line("markers", "device: runs on the device of --device (cpu by default, cuda on a GPU)")
    share_the_cores()
    if config.getoption("--device") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device cuda but torch.cuda.is_available() is False (torch {torch.__version__}, "
                                f"built for CUDA {torch.version.cuda})")


# ---- make test's workers (pytest-xdist, --dist loadfile): the cores shared out, the longest files first
def share_the_cores() -> None:
    """In an xdist worker (PYTEST_XDIST_WORKER_COUNT set), give this worker and every process it starts (notebook
    kernels, nbgrader's runs, TP ranks, JupyterLab's kernels) its share of the cores: ``OMP_NUM_THREADS`` and torch's
    thread count. Two workers, each running PyTorch on every core, would make each other's threads wait.
    A value already in the environment is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = threads_per_worker(workers)  # the cores shared out as among TP ranks
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# Files that run whole lessons, longest first (measured on 2 cores): handed out before the many short files, so
# that the short ones fill in beside them instead of one long file running alone at the end.
LONG_FILES = ("tests/test_claims_can_fail.py", "tests/test_classroom.py", "tests/browser/test_widgets_browser.py",
              "tests/test_site.py", "notebooks/06_prefill_engine.ipynb", "notebooks/08_chunked_prefill.ipynb")


def pytest_collection_modifyitems(config, items):
    """Under ``--no-loadscope-reorder`` (make test) xdist hands out files in this order: LONG_FILES first, then the
    notebooks, then the rest as collected."""
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES) + (not path.startswith("notebooks/"))
    items.sort(key=rank)  # stable: the order inside a file, and among the rest, is kept


@pytest.fixture(autouse=True)
def _seeded_torch_rng():
    """Every test starts from the same torch RNG state: a test that draws its own inputs draws the same ones
    in every run, so that a failure reproduces (a test that needs other draws seeds them itself)."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def device(request) -> str:
    """The device of ``--device``: "cpu" or "cuda"."""
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    """2 layers, d_model 64, 4 heads of 16: the article's shape of model, small enough for many examples."""
    return ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300,
                       max_position=256)


@pytest.fixture(scope="session")
def make_qkv():
    return _make_qkv


def _model_pair(cfg: ModelConfig, seed: int = 0) -> tuple[Transformer, Transformer]:
    """The fp32 model and its float64 twin (the same fp32 weight values, upcast): the exact-math yardstick."""
    model = Transformer(cfg, init_weights(cfg, seed))
    return model, float64_twin(model)


def _make_requests(lens, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """``serve.workloads.make_requests`` as token-id tensors ``[L_i]`` in ``[0, vocab)``."""
    return [torch.tensor(r) for r in workloads.make_requests(list(lens), vocab, seed)]


@pytest.fixture(scope="session")
def model_pair():
    return _model_pair


@pytest.fixture(scope="session")
def make_requests():
    return _make_requests


@pytest.fixture(scope="module")
def block_run():
    """One block (d_model 64, 4 heads), its input rows ``[12, 64]`` and the two requests' lengths ``[3, 9]``
    (lesson 02's block-step tests and measure.batch_invariance's)."""
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=50, max_position=32)
    model = Transformer(cfg, init_weights(cfg, seed=3))
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(4))
    return model, x, [3, 9]
