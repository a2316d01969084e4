"""The TP rank timeline lessons 04 and 06 draw: one forward, one row per rank, from the ranks' collective traces."""
from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..core.batch import cumulative
from ..core.config import ModelConfig
from ..style import ATTENTION, COMM, LINEAR, MIN_FONT, OTHER, TEXT, request_color, request_name
from ..tp.dryrun import trace_signature
from ..validate import check_lengths


def short_cu(cu: Sequence[int]) -> str:
    """``cu_seqlens`` as text, its middle elided past 6 entries."""
    cu = list(cu)
    return str(cu) if len(cu) <= 6 else f"[{cu[0]}, {cu[1]}, {cu[2]}, ..., {cu[-1]}] ({len(cu) - 1} requests)"


def _box(ax, x, y, w, h, color, text="", text_color="white", gid=None):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1, gid=gid))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=MIN_FONT, color=text_color)


def _packing_label(lens: list[int]) -> str:
    if len(set(lens)) == 1:
        return f"{len(lens)} x {lens[0]}"
    if len(lens) <= 3:
        return " + ".join(f"{request_name(i)}={n}" for i, n in enumerate(lens))
    return f"{len(lens)} requests"


def tp_trace_timeline(traces_by_packing: Sequence[Sequence[Sequence]], packings: Sequence[Sequence[int]],
                      cfg: ModelConfig | None = None, source: str = "the ranks' records", lm_head: bool = True) -> Figure:
    """Claims C11, C12: one TP forward, one row per rank, from the ranks' collective traces.

    ``traces_by_packing[i][r]``: rank r's ``CollectiveRecord`` list for the batch of request
    lengths ``packings[i]`` (a real ``TPResult.traces`` or a dry run per rank). All must be the
    same, record for record, on every rank and for every packing (else ValueError: real ranks
    would wait forever, or the trace would depend on the packing). Layer 0 is drawn in detail
    (green linear layers with each rank's shapes, blue attention on the rank's own heads), the
    other layers compactly; every all-reduce is one purple bar across all ranks (gid
    ``allreduce-k``), numbered; the replicated embedding and LayerNorms are grey, the replicated
    LM head green (``lm_head=False``: no LM head box, for ranks whose forward returns hidden states and
    never runs ``compute_logits``). The packings are drawn underneath with their ``cu_seqlens``, and a note says
    that they all gave this trace (one packing: the note sits under its ``cu_seqlens``);
    ``source`` says where the traces came from.
    """
    cfg = cfg or ModelConfig()
    runs = [[list(t) for t in traces] for traces in traces_by_packing]
    packs = [check_lengths(p) for p in packings]
    if not packs or len(packs) != len(runs):
        raise ValueError(f"give one list of per-rank traces per packing: {len(runs)} traces for {len(packs)} packings")
    traces = runs[0]
    if not traces or not traces[0]:
        raise ValueError("traces must hold at least one rank with at least one collective")
    sig = trace_signature(traces[0])
    for i, run in enumerate(runs):
        for r, t in enumerate(run):
            if trace_signature(t) != sig:
                raise ValueError(f"packing {packs[i]}, rank {r}: the trace differs from rank 0's of {packs[0]}")
    n_ranks, first, one = len(traces), traces[0][0], len(packs) == 1
    t, d, hl, dh = first.shape[0], cfg.d_model, cfg.n_heads // n_ranks, cfg.d_head
    fl = cfg.d_ffn // n_ranks
    row_h, gap = 1.0, 0.3
    top = n_ranks * (row_h + gap)
    fig = Figure(figsize=(14, 2.5 + 1.0 * n_ranks + 0.42 * len(packs)))
    ax = fig.add_axes((0.075, 0.01, 0.92, 0.97))
    ax.axis("off")
    # (label on rank 0, shapes above rank 0, colour, width); "AR" = an all-reduce
    by_cu = "by\ncu_seqlens" if one else "by cu_seqlens"  # one packing: a shorter figure, the label on two lines
    detail = [("LN", "", OTHER, 0.42), ("QKV", f"[T,{d}]\n→[T,{3 * hl * dh}]", LINEAR, 1.45),
              ("attention", f"[T,{hl},{dh}]\n{by_cu}", ATTENTION, 1.55),
              ("out proj", f"[T,{hl * dh}]\n→[T,{d}]\npartial", LINEAR, 1.45), ("AR", "", COMM, 0.32),
              ("LN", "", OTHER, 0.42), ("FFN-up", f"[T,{d}]\n→[T,{fl}]", LINEAR, 1.45),
              ("FFN-down", f"[T,{fl}]\n→[T,{d}]\npartial", LINEAR, 1.45), ("AR", "", COMM, 0.32)]
    compact = [("", "", OTHER, 0.06), ("", "", LINEAR, 0.16), ("", "", ATTENTION, 0.2), ("", "", LINEAR, 0.16),
               ("AR", "", COMM, 0.2), ("", "", OTHER, 0.06), ("", "", LINEAR, 0.16), ("", "", LINEAR, 0.16),
               ("AR", "", COMM, 0.2)]

    def rank_y(r):
        return (n_ranks - 1 - r) * (row_h + gap) + gap / 2

    def replicated(x, text):
        for r in range(n_ranks):
            _box(ax, x, rank_y(r), 0.75, row_h, OTHER, text, text_color=TEXT)
        return x + 0.8

    x = replicated(0.0, "emb")
    k = 0
    for layer in range((len(traces[0]) + 1) // 2):
        x0 = x
        for label, shapes, color, w in (detail if layer == 0 else compact):
            if label == "AR":
                _box(ax, x, 0.05, w, top - 0.1, COMM, gid=f"allreduce-{k}")
                ax.text(x + w / 2, top + 0.05 + (0.45 if layer == 0 else 0), str(k + 1), ha="center", va="bottom",
                        fontsize=MIN_FONT, color=TEXT)
                k += 1
            else:
                for r in range(n_ranks):
                    text = label if r == 0 or label == "LN" else (
                        f"heads {r * hl}-{(r + 1) * hl - 1}" if color == ATTENTION and label else "")
                    if r == 0 and color == ATTENTION and label:
                        text = f"attention\nheads 0-{hl - 1}"
                    _box(ax, x, rank_y(r), w, row_h, color, text, text_color=TEXT if color == OTHER else "white",
                         gid=f"local-{r}-{layer}")
                if shapes:
                    ax.text(x + w / 2, top + 0.05, shapes, ha="center", va="bottom", fontsize=MIN_FONT, color=TEXT)
            x += w + 0.04
        ax.text((x0 + x) / 2, -0.08, f"layer {layer}" if layer in (0, 1) else str(layer), ha="center", va="top",
                fontsize=MIN_FONT, color=TEXT)
        x += 0.1
    x = replicated(x, "LN")
    if lm_head:
        for r in range(n_ranks):  # the LM head is a linear layer (replicated here)
            _box(ax, x, rank_y(r), 0.55, row_h, LINEAR, "LM")
        x += 0.6
    for r in range(n_ranks):
        ax.text(-0.12, rank_y(r) + row_h / 2, f"rank {r}", ha="right", va="center", fontsize=MIN_FONT + 1, color=TEXT)
    shape = f"[{', '.join(map(str, first.shape))}]"
    ax.text(-1.3, top + 0.95,
            f"One forward at TP={n_ranks}: {len(sig)} all-reduces (purple, numbered), each of {shape} {first.dtype}, "
            f"{first.bytes:,} B per rank. Layers 1-{len(sig) // 2 - 1} repeat layer 0, drawn compact."
            f"\nGreen: linear layers (shapes per rank above); blue: attention on the rank's own heads, no collective;"
            f"\ngrey: the embedding and the LayerNorms, whole on every rank; "
            + ("the LM head (green) is replicated too." if lm_head else "no LM head: this forward returns hidden states."),
            fontsize=MIN_FONT + 1, color=TEXT, va="bottom")
    width = 8.0  # the packings that all produced exactly this trace, as token strips
    for i, lens in enumerate(packs):
        y = -0.75 - 0.48 * i
        scale = width / sum(lens)
        ax.text(-0.12, y + 0.17, _packing_label(lens), ha="right", va="center", fontsize=MIN_FONT, color=TEXT)
        cu = cumulative(lens)
        for j, n in enumerate(lens):
            ax.add_patch(Rectangle((cu[j] * scale, y), n * scale, 0.34, facecolor=request_color(j),
                                   edgecolor="white", linewidth=0.4))
        ax.text(width + 0.2, y + 0.17, f"cu_seqlens = {short_cu(cu)}", va="center", fontsize=MIN_FONT, color=TEXT)
    if one:
        ax.text(width + 0.2, -0.75 + 0.17 - 0.5, f"The same trace, record for record, on every rank ({source}).",
                va="center", fontsize=MIN_FONT + 1, color=TEXT)
    else:
        ax.text(width + 5.2, -0.75 - 0.24 * (len(packs) - 1) + 0.17,
                f"These {len(packs)} packings of the same {t} tokens\ngave exactly this trace, record for record,\n"
                f"on every rank ({source}).", va="center", fontsize=MIN_FONT + 1, color=TEXT)
    ax.set_xlim(-1.3, x + 0.1)
    ax.set_ylim(-0.75 - 0.48 * len(packs), top + 2.1)
    return fig
