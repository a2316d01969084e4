"""What a lesson may touch: the rules the architecture test enforces on every lesson's code.

A lesson is its notebook (``notebooks/NN_*.ipynb``, code cells) and its helper module
(``lessons_lib/course/lNN_*.py``). It uses the engine only through its public API and the course kit:

- no lesson imports another lesson (``from .l00_setup import ...``): what two lessons share belongs
  in the engine or in the kit;
- no underscored name of ``lessons_lib`` (imported, or read as ``module._name``);
- no patching: no ``setattr``/``delattr``/``globals()``/``vars()``/``__dict__``, and no assignment to an
  attribute other than a widget's or a figure's own (``w.value = ...``). A lesson that shows a bug
  turns on one of the engine's named breakages (``with lessons_lib.faults.injected(name):``).

Run on files: ``python tests/lesson_rules.py lessons_lib/course/l03_attention.py notebooks/03_*.ipynb``.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

# Attributes a lesson may set: widgets' and figures' own state, and the names of the lesson's own functions.
SETTABLE = {"value", "min", "max", "options", "description", "disabled", "outputs", "layout", "__name__", "__doc__"}
PATCH_CALLS = {"setattr", "delattr", "globals", "vars"}
LESSON_MODULE = re.compile(r"(^|\.)l\d\d_\w+$")


def _source(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    import nbformat

    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    # IPython magics and shell lines are not Python
    return "\n".join(re.sub(r"^\s*[%!].*$", "pass", c, flags=re.M) for c in cells)


def violations(path: Path, source: str | None = None) -> list[str]:
    """``["<file>:<line>: <what>", ...]`` for every rule ``path`` breaks (``source``: its text, if given)."""
    tree = ast.parse(_source(path) if source is None else source)
    own = re.match(r"l?(\d\d)_", path.name)
    own_module = re.compile(rf"(^|\.)l{own.group(1)}_\w+$") if own else None
    imported: set[str] = set()
    out = []

    def bad(node, what):
        out.append(f"{path.name}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            from_lessons = node.level > 0 or module.startswith("lessons_lib")
            lessons = [module] if LESSON_MODULE.search(module) else (
                [a.name for a in node.names if LESSON_MODULE.search(a.name)]
                if module in ("", "course", "lessons_lib.course") else [])
            if from_lessons and [m for m in lessons if not (own_module and own_module.search(m))]:
                bad(node, f"imports another lesson ({'.' * node.level}{module})")
            for a in node.names:
                if from_lessons and a.name.startswith("_"):
                    bad(node, f"imports the private name {a.name}")
                imported.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_") and not node.attr.startswith("__") and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                bad(node, f"reads the private name {ast.unparse(node)}")
            if node.attr == "__dict__":
                bad(node, f"reaches into {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PATCH_CALLS:
            bad(node, f"calls {node.func.id}()")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in (e for tgt in targets for e in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])):
                if not isinstance(t, ast.Attribute):
                    continue
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id == "self":
                    continue
                if t.attr not in SETTABLE or (isinstance(root, ast.Name) and root.id in imported):
                    bad(node, f"patches {ast.unparse(t)}")
    return out


if __name__ == "__main__":
    found = [v for arg in sys.argv[1:] for v in violations(Path(arg))]
    print("\n".join(found) or "no violations")
    sys.exit(1 if found else 0)
