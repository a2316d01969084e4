"""The package's shape: no import cycles, a light core that reads in one sitting, validation once
at the boundary (no host sync inside a layer), one weight format, and nothing pointing outside
the repository."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lessons_lib.core import model as model_module
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lessons_lib"
CORE_MAX_LINES = 1250        # "about 1,200": the whole engine a learner reads (GQA included), docstrings included
CORE_MAX_FILE_LINES = 350


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """lessons_lib modules ``path`` imports (module level or inside functions, not under ``if TYPE_CHECKING:``),
    as absolute names."""
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(block)}  # imports for annotations only: no edge at run time
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lessons_lib")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("lessons_lib"):
                continue
            for alias in node.names:  # "from . import viz" imports a module
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return out & set(MODULES)


# Edges that exist only at run time, each imported inside one function after every module is loaded, with the reason.
RUN_TIME_EDGES = {
    ("lessons_lib.tp.workers", "lessons_lib.faults"):
        "a spawned TP rank turns on its parent's faults at start-up (_bootstrap); faults patches the engine, so it "
        "imports the engine, tp.workers included",
}
GRAPH = {m: _imports(p) - {m} - {b for a, b in RUN_TIME_EDGES if a == m} for m, p in MODULES.items()}


def test_every_run_time_edge_is_imported_inside_a_function_only():
    for (a, b), why in RUN_TIME_EDGES.items():
        tree = ast.parse(MODULES[a].read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        named = [n for n in top if b.rsplit(".", 1)[-1] in {x.name for x in n.names} or (getattr(n, "module", "") or "").endswith(b.rsplit(".", 1)[-1])]
        assert not named, f"{a} imports {b} at module level: the edge would be an import-time cycle ({why})"
        assert b in _imports(MODULES[a]), f"{a} no longer imports {b}: drop it from RUN_TIME_EDGES"


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_walker_finds_a_planted_cycle(monkeypatch):
    """The cycle test can fail: plant one edge back from core to serve."""
    monkeypatch.setitem(GRAPH, "lessons_lib.core.batch", GRAPH["lessons_lib.core.batch"] | {"lessons_lib.serve.engine"})
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()


def test_core_imports_only_core_and_the_checks():
    for m, deps in GRAPH.items():
        if m.startswith("lessons_lib.core"):
            outside = sorted(d for d in deps if not d.startswith("lessons_lib.core") and d != "lessons_lib.validate")
            assert not outside, f"{m} imports {outside}: core/ never imports the other subpackages"
    assert GRAPH["lessons_lib.validate"] <= {"lessons_lib"}, "the checks sit below the engine"


def test_importing_core_loads_no_processes_plots_or_serving():
    """What ``import lessons_lib.core`` adds beyond torch itself (torch already loads
    multiprocessing and socket), and no core module names them in its source."""
    code = ("import sys, torch, numpy; before = set(sys.modules); import lessons_lib.core; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    new = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    banned = ("matplotlib", "multiprocessing", "socket", "tempfile", "ipywidgets", "transformers",
              "lessons_lib.tp", "lessons_lib.serve", "lessons_lib.measure", "lessons_lib.course")
    assert not [m for m in new if m.startswith(banned)], [m for m in new if m.startswith(banned)]
    for m, path in MODULES.items():
        if m.startswith("lessons_lib.core"):
            src = path.read_text()
            assert not re.search(r"^\s*(import|from)\s+(multiprocessing|socket|matplotlib|tempfile)\b", src, re.M), m


def test_core_reads_in_one_sitting():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PKG / "core").glob("*.py")}
    assert sum(sizes.values()) <= CORE_MAX_LINES, f"core/ has {sum(sizes.values())} lines: {sizes}"
    assert max(sizes.values()) <= CORE_MAX_FILE_LINES, sizes
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"core/\s.*?\b([\d,]+) lines", readme)
    assert stated and int(stated.group(1).replace(",", "")) == sum(sizes.values()), \
        f"the README's repository map must give core/'s line count ({sum(sizes.values())})"


def test_nothing_points_outside_the_repo():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # built from pieces, so that this file does not match itself
    pattern = re.compile("|".join(["/" + "work/", r"\.\./" + "shared", "shared/" + "(course|seed|tools)", "/" + "root/",
                                   r"\bissues?" + r" ?#?\d+\b"]), re.I)
    hits = []
    for name in files:
        if name.endswith((".png", ".json", ".lock")) or name.startswith("bench/results"):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if pattern.search(line) and "nbclient#" not in line and "nbclient/issues" not in line:
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


# ---- validation once, no host sync in a layer -----------------------------------------------------

SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "any", "all")
SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero", "aten::masked_select",
            "aten::equal", "aten::isfinite"}
CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=128, vocab_size=300, max_position=256)
PURE = ("loop", "masked", "padded", "sdpa")


def _batch():
    return pack([torch.arange(n) % CFG.vocab_size for n in (10, 30, 1, 7, 7, 7)])


@pytest.mark.parametrize("backend", PURE)
def test_a_layer_makes_no_host_sync(backend, monkeypatch):
    """Every Tensor method that reads a value back to Python, counted while a block runs."""
    inside, calls = [False], []
    real_block = model_module.Block.forward

    def block(self, x):
        inside[0] = True
        try:
            return real_block(self, x)
        finally:
            inside[0] = False

    monkeypatch.setattr(model_module.Block, "forward", block)
    for name in SYNCS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            if inside[0]:
                calls.append(_name)
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    model = Transformer(CFG)
    model(_batch(), attn_backend=backend)
    assert calls == [], f"{backend}: host reads inside a layer: {calls}"


@pytest.mark.parametrize("backend", PURE)
def test_profiler_sees_no_sync_op_inside_a_layer(backend):
    """The same on the op trace: ops that wait for a value (item, nonzero, ...) appear only
    outside the blocks (the batch checks at the boundary, once per forward)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = Transformer(CFG)
    for block in model.layers:
        real = block.forward

        def wrapped(x, _real=real):
            with record_function("one_layer"):
                return _real(x)
        block.forward = wrapped
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(_batch(), attn_backend=backend)

    def in_layer(ev):
        while ev is not None:
            if ev.name == "one_layer":
                return True
            ev = ev.cpu_parent
        return False

    events = prof.events()
    assert sum(ev.name == "one_layer" for ev in events) == CFG.n_layers
    bad = sorted({ev.name for ev in events if ev.name in SYNC_OPS and in_layer(ev)})
    assert not bad, f"{backend}: ops that wait for a value inside a layer: {bad}"
    assert {ev.name for ev in events if ev.name in SYNC_OPS and not in_layer(ev)}, \
        "the boundary checks should show up outside the layers (else this test sees nothing)"


# ---- one weight format --------------------------------------------------------------------------

def test_state_dict_is_the_weight_format_everywhere():
    """TP=1 here; TP=2 from a model's state_dict() is proven in test_tp.py (its TPRuntime of the
    article batches, held to the fp64 rule, and its tp_forward of 10,000 tokens are both given one)."""
    w = init_weights(CFG, seed=3)
    model = Transformer(CFG, w)
    sd = model.state_dict()
    assert list(sd) == list(CFG.weight_shapes()) and all(torch.equal(sd[k], w[k]) for k in w)
    again = Transformer(CFG, sd)  # a model's own state_dict is accepted as full weights
    again.load_state_dict(model.state_dict())  # and load_state_dict round-trips
    batch = _batch()
    assert torch.equal(again(batch), model(batch))
