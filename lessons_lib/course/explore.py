"""Widget plumbing: every explorer is a pure state function plus a thin ipywidgets wrapper built here.
"""
from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Sequence

from ..style import to_png

WIDGET_DPI = 80

def ipywidgets_module():
    import ipywidgets  # imported lazily: the pure functions work without it
    return ipywidgets

def tagged(widget, css_class: str):
    widget.add_class(css_class)
    return widget

def explorer(css_class: str, controls: list, readouts: list, update):
    """Wire an explorer: ``update`` runs on every change of a control and once now; the
    controls sit in a row above the readouts, all in a VBox of class ``css_class``."""
    w = ipywidgets_module()
    for control in controls:
        control.observe(update, names="value")
    update()
    return tagged(w.VBox([w.HBox(controls), *readouts]), css_class)

def show_figure(out, fig, dpi: int = WIDGET_DPI) -> None:
    """Replace the content of an ``ipywidgets.Output`` with the figure as an inline PNG."""
    png = base64.b64encode(to_png(fig, dpi=dpi)).decode("ascii")
    w, h = fig.get_size_inches()
    out.outputs = ({"output_type": "display_data",
                    "data": {"image/png": png, "text/plain": f"<Figure {int(w * dpi)}x{int(h * dpi)}>"},
                    "metadata": {}},)

def parse_lengths(text: str, max_requests: int = 64, max_length: int = 4096) -> list[int]:
    """``"10, 30"`` → ``[10, 30]``; commas or spaces; every length in ``[1, max_length]``."""
    if not isinstance(text, str):
        raise ValueError(f"lengths must be a string like '10, 30', got {type(text).__name__}")
    parts = [p for p in text.replace(",", " ").split() if p]
    if not parts:
        raise ValueError("lengths is empty: type request lengths like '10, 30'")
    lens = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise ValueError(f"lengths: {p!r} is not a whole number") from None
        if not 1 <= n <= max_length:
            raise ValueError(f"lengths: every request needs 1..{max_length} tokens, got {n}")
        lens.append(n)
    if len(lens) > max_requests:
        raise ValueError(f"lengths: at most {max_requests} requests, got {len(lens)}")
    return lens


def parse_query_key_lengths(text: str, max_requests: int = 8, max_length: int = 512) -> tuple[list[int], list[int]]:
    """``"20:50, 10"`` → ``([20, 10], [50, 10])``: each request ``L`` (a prompt) or ``L_q:L_k`` (a chunk of L_q
    queries after ``L_k − L_q`` cached keys; ``L_k >= L_q``), commas or spaces between requests (``parse_lengths``'
    limits on each side)."""
    if not isinstance(text, str):
        raise ValueError(f"lengths must be a string like '10, 30' or '20:50, 10', got {type(text).__name__}")
    items = text.replace(",", " ").split()
    lens_q = parse_lengths(" ".join(item.split(":")[0] for item in items), max_requests, max_length)
    lens_k = parse_lengths(" ".join(item.split(":")[-1] for item in items), max_requests, max_length)
    for item, nq, nk in zip(items, lens_q, lens_k):
        if item.count(":") > 1:
            raise ValueError(f"lengths: {item!r} has more than one ':'; write a request as L or L_q:L_k")
        if nk < nq:
            raise ValueError(f"lengths: {item!r} has fewer keys than queries; a chunk sees its own tokens "
                             "and the cached ones, L_k >= L_q")
    return lens_q, lens_k

def html_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A ``<table>``: a header row of ``columns``, then one row per item of ``rows``, each value as ``str``,
    HTML-escaped; every row must have one value per column."""
    def row(values, tag, style):
        return "<tr>" + "".join(f"<{tag} style='{style}'>{html.escape(str(v))}</{tag}>" for v in values) + "</tr>"
    body = []
    for values in rows:
        if len(values) != len(columns):
            raise ValueError(f"html_table: a row has {len(values)} values for {len(columns)} columns: {list(values)!r}")
        body.append(row(values, "td", "padding:0 8px"))
    return f"<table>{row(columns, 'th', 'padding:0 8px;text-align:left')}{''.join(body)}</table>"
