"""The engine's own code, shown in a lesson next to the claim that depends on it.

``show_source(varlen_attention)`` displays the function as it is in ``lessons_lib`` (its file
and line numbers in the heading): what the reader sees is what runs, never a copy.
"""
from __future__ import annotations

import inspect
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]


def source_text(obj, start: str | None = None, stop: str | None = None) -> tuple[str, str]:
    """``(heading, code)`` of a function, class or method; ``start``/``stop`` cut it to the lines from
    the first one containing ``start`` up to (not including) the first later one containing ``stop``."""
    obj = inspect.unwrap(obj)  # a decorated function (e.g. @torch.no_grad) shows its own code, not the wrapper's
    lines, first = inspect.getsourcelines(obj)
    lo = next((i for i, line in enumerate(lines) if start in line), None) if start else 0
    if lo is None:
        raise ValueError(f"{start!r} is not in the source of {obj.__qualname__}")
    hi = next((i for i in range(lo + 1, len(lines)) if stop in lines[i]), len(lines)) if stop else len(lines)
    path = pathlib.Path(inspect.getsourcefile(obj)).resolve()
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    heading = f"{where}, lines {first + lo}-{first + hi - 1}: {obj.__qualname__}"
    return heading, textwrap.dedent("".join(lines[lo:hi])).rstrip()


def show_source(obj, start: str | None = None, stop: str | None = None):
    """Display the code of ``obj`` (see ``source_text``) as a Markdown code block in a notebook."""
    from IPython.display import Markdown
    heading, code = source_text(obj, start, stop)
    return Markdown(f"`{heading}`\n\n```python\n{code}\n```")
