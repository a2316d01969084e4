"""Lesson 00's module: the figures, the all-reduce explorer, the notebook's helpers and the exercise checkers."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from helpers import attempt, by_class, gids, png_of, stub

from lessons_lib.core import linear
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.course import l00_setup as L
from lessons_lib.course.grading import score
from lessons_lib.tp.dryrun import expected_trace


def _itemsize(cfg):
    return torch.empty((), dtype=cfg.dtype).element_size()


# ---- figures --------------------------------------------------------------------------------------

def test_course_map_lists_every_lesson_and_its_claims():
    fig = L.course_map()
    texts = [t.get_text() for t in fig.axes[0].texts]
    notebooks = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert [n for n, *_ in L.LESSONS] == [p.name[:2] for p in notebooks]
    for num, _, _, claims, _ in L.LESSONS:
        assert num in texts and claims in texts


def test_s1_tp_split_draws_split_and_whole_biases_and_one_all_reduce():
    fig = L.tp_split(ModelConfig())
    assert {"col-w-0", "col-w-1", "col-b-0", "col-b-1", "row-w-0", "row-w-1", "all-reduce", "row-b"} <= set(gids(fig))
    text = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "[T x 768]" in text and "[T x 1024]" in text and "16 all-reduces" in text
    assert "ONCE" in text and "split with its outputs" in text


def test_c1_allreduce_growth_draws_the_payload_the_ring_traffic_the_measured_points_and_the_mark(tiny_cfg):
    measured = {n: expected_trace(tiny_cfg, n) for n in (10, 100)}
    fig = L.allreduce_growth(tiny_cfg, tokens=[1, 10, 100, 1000], mark=300, measured=measured, world_size=4)
    assert {"measured-bytes-10", "measured-bytes-100", "mark", "mark-ring", "ring-2", "ring-4", "ring-8"} <= set(gids(fig))
    left, right = fig.axes
    count = 2 * tiny_cfg.n_layers
    assert list(left.get_lines()[0].get_ydata()) == [n * tiny_cfg.d_model * 4 for n in (1, 10, 100, 1000)]
    rings = {ln.get_gid(): ln for ln in right.get_lines() if (ln.get_gid() or "").startswith("ring-")}
    for p, line in rings.items():  # per forward, all ranks: count x 2(p-1) payloads
        w = int(p.split("-")[1])
        assert list(line.get_ydata()) == [count * 2 * (w - 1) * n * tiny_cfg.d_model * 4 for n in (1, 10, 100, 1000)]
    assert rings["ring-4"].get_linewidth() > rings["ring-2"].get_linewidth()
    # the mark sits on the chosen TP's line, not on the payload line
    mark = next(ln for ln in right.get_lines() if ln.get_gid() == "mark-ring")
    assert list(mark.get_ydata()) == [count * 2 * 3 * 300 * tiny_cfg.d_model * 4]
    assert "TP = 4" in fig._suptitle.get_text() and f"{count} all-reduces" in fig._suptitle.get_text()
    assert "per all-reduce" in left.get_title() and "per forward" in right.get_title()
    one = L.allreduce_growth(tiny_cfg, tokens=[1, 10], mark=5, world_size=1)
    assert "no all-reduce" in one._suptitle.get_text() and "mark" not in gids(one)
    with pytest.raises(ValueError, match="world_size"):
        L.allreduce_growth(tiny_cfg, world_size=3)


def test_course_map_minutes_are_the_lessons_own():
    """The map in lesson 00 states each lesson's time as the lesson itself states it."""
    stated = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")):
        head = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells[:3] if c.cell_type == "markdown")
        minutes = [int(m) for m in re.findall(r"[Aa]bout (\d+) minutes", head)]
        stated[path.name[:2]] = minutes[-1] if minutes else None
    assert {num: minutes for num, *_, minutes in L.LESSONS} == stated


# ---- the explorer ---------------------------------------------------------------------------------

def test_c1_allreduce_state_numbers():
    s = L.allreduce_state(1000)
    assert (s["count"], s["shape"], s["bytes_each"]) == (16, [1000, 512], 1000 * 512 * 4)
    assert s["bytes_per_forward"] == 16 * 2_048_000 and s["ring_sent_each"] == 2_048_000  # 2(p-1)/p = 1 at TP=2
    assert s["ring_sent_total"] == 16 * 2 * (2 - 1) * 2_048_000
    assert L.allreduce_text(s).startswith("TP=2: 16 all-reduces per forward on each rank | each [1000, 512] float32 = 2,048,000 B")
    eight = L.allreduce_state(1000, world_size=8)
    assert eight["bytes_each"] == s["bytes_each"]  # the payload does not shrink with TP
    assert eight["ring_sent_total"] == 16 * 2 * 7 * 2_048_000 and eight["ring_sent_each"] == 2 * 7 * 2_048_000 // 8
    assert "1.75 x its payload" in L.allreduce_text(eight)
    assert L.allreduce_state(10, "bfloat16")["bytes_each"] == 10 * 512 * 2


def test_c1_tp_1_makes_no_all_reduce():
    s = L.allreduce_state(1000, world_size=1)
    assert (s["count"], s["bytes_each"], s["bytes_per_forward"], s["ring_sent_total"]) == (0, 0, 0, 0)
    assert "nobody to add partial sums with" in L.allreduce_text(s)


def test_every_control_changes_the_readout():
    base = L.allreduce_text(L.allreduce_state(10, "float32", 2))
    for other in (L.allreduce_state(11, "float32", 2), L.allreduce_state(10, "bfloat16", 2),
                  L.allreduce_state(10, "float32", 4), L.allreduce_state(10, "float32", 1)):
        assert L.allreduce_text(other) != base


@pytest.mark.parametrize("bad", [(0,), (10, "int8"), (10, "float32", 3), (10, "float32", 16), (1.5,)])
def test_allreduce_state_refuses_bad_input(bad):
    with pytest.raises(ValueError):
        L.allreduce_state(*bad)


def test_ring_bytes_sent():
    assert L.ring_bytes_sent(1000, 1) == 0
    assert L.ring_bytes_sent(1000, 2) == 1000
    assert L.ring_bytes_sent(1024, 8) == 2 * 7 * 1024 // 8


def test_allreduce_explorer_callbacks_follow_every_control():
    box = L.allreduce_explorer()
    w = by_class(box)
    assert {"arx-tokens", "arx-world-size", "arx-dtype", "arx-text", "arx-figure"} <= set(w)
    text, png = w["arx-text"].value, png_of(w["arx-figure"])
    assert "20,480 B" in text
    w["arx-tokens"].value = 1000
    assert "2,048,000 B" in w["arx-text"].value and png_of(w["arx-figure"]) != png
    w["arx-dtype"].value = "bfloat16"
    assert "1,024,000 B" in w["arx-text"].value
    before = w["arx-text"].value
    w["arx-world-size"].value = 8
    assert w["arx-text"].value != before and "all 8 ranks" in w["arx-text"].value
    w["arx-world-size"].value = 1
    assert "0 all-reduces" in w["arx-text"].value


# ---- helpers the notebook calls ---------------------------------------------------------------------

def test_s1_shard_table_and_heads_held(tiny_cfg):
    weights = init_weights(tiny_cfg, 0)
    full = Transformer(tiny_cfg, weights)
    ranks = [Transformer(tiny_cfg, weights, group=LocalGroup(r, 2)) for r in (0, 1)]
    table = {name: (a, b, cut) for name, a, b, cut in L.shard_table(full, ranks[0])}
    assert table["attn.qkv.bias"] == ([3 * 64], [3 * 32], "split: output features")
    assert table["attn.out_proj.weight"] == ([64, 64], [64, 32], "split: input features")
    assert table["mlp.fc_down.bias"][2] == "whole (replicated)"
    assert L.heads_held(weights, ranks[0]) == {"Q": [0, 1], "K": [0, 1], "V": [0, 1]}
    assert L.heads_held(weights, ranks[1]) == {"Q": [2, 3], "K": [2, 3], "V": [2, 3]}
    assert "how" in L.format_table(L.shard_table(full, ranks[0]), ("p", "a", "b", "how"))


def test_s1_heads_held_sees_a_contiguous_qkv_cut(tiny_cfg, monkeypatch):
    """The breakage of S1: a plain column cut of the fused weight gives rank 0 Q of every head."""
    monkeypatch.setattr(linear.QKVParallelLinear, "shard_rows", linear.ColumnParallelLinear.shard_rows)
    weights = init_weights(tiny_cfg, 0)
    rank0 = Transformer(tiny_cfg, weights, group=LocalGroup(0, 2))
    assert L.heads_held(weights, rank0) == {"Q": [0, 1, 2, 3], "K": [0, 1], "V": []}


def test_s1_follow_request_records_the_pre_ln_order_and_removes_its_hooks(tiny_cfg):
    model = Transformer(tiny_cfg, seed=0)
    calls, blocks, out = L.follow_request(model, lambda: model(pack([torch.arange(7)])))
    assert [p for p, _ in calls] == ["ln_1", "attn.qkv", "attn.out_proj", "ln_2", "mlp.fc_up", "mlp.fc_down"]
    assert dict(calls)["attn.qkv"] == [7, 3 * 64] and blocks == [[7, 64]] * tiny_cfg.n_layers
    assert list(out.shape) == [7, 64]
    assert all(not m._forward_hooks for m in model.modules())


def test_machine_report_names_device_dtype_every_backend_and_the_tp_backend():
    report = L.machine_report(64)
    assert "device: " in report and "dtype: " in report
    for name in ("loop", "masked", "padded", "sdpa", "flex", "flash", "torch_varlen"):
        assert f"\n{name} " in report
    assert "TP=2 collectives: " in report
    rows = L.backend_rows("cpu", torch.float32, 64)
    assert {r[0]: r[1] for r in rows}["sdpa"] == "yes"


# ---- exercise checkers --------------------------------------------------------------------------------

def _params(cfg, tied=True, wpe=True, biases=True, ln=True, ln_f=True):
    d, k, f, n = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, cfg.n_layers
    total = cfg.vocab_size * d * (1 if tied else 2) + (cfg.max_position * d if wpe else 0)
    per_layer = 3 * k * d + k * d + f * d + d * f + ((3 * k + d + f + d) if biases else 0) + (4 * d if ln else 0)
    return total + n * per_layer + (2 * d if ln and ln_f else 0)


def _rank_params(cfg, tp, split_row_bias=False, whole_col_bias=False):
    d, k, f, n = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, cfg.n_layers
    whole = cfg.vocab_size * d + cfg.max_position * d + n * 4 * d + 2 * d + (0 if split_row_bias else n * 2 * d)
    whole += n * (3 * k + f) if whole_col_bias else 0
    cut = n * (3 * k * d + k * d + f * d + d * f) + (n * 2 * d if split_row_bias else 0)
    cut += 0 if whole_col_bias else n * (3 * k + f)
    return whole + cut // tp


def _only_tp1(fn):
    """A whole-model count that ignores tp_size: right at TP=1 only."""
    return lambda c, tp: fn(c)


def test_s1_rank_params_checker_at_tp_1_counts_the_whole_model(capsys):
    assert L.check_rank_params(_rank_params)
    assert L.check_rank_params(stub) is False and "not attempted yet" in capsys.readouterr().out
    assert "tied" in attempt(L.check_rank_params, _only_tp1(lambda c: _params(c, tied=False)))
    assert "position embedding" in attempt(L.check_rank_params, _only_tp1(lambda c: _params(c, wpe=False)))
    assert "biases of the four" in attempt(L.check_rank_params, _only_tp1(lambda c: _params(c, biases=False)))
    assert "ln_1, ln_2 per block, and ln_f" in attempt(L.check_rank_params, _only_tp1(lambda c: _params(c, ln=False)))
    assert "final LayerNorm ln_f" in attempt(L.check_rank_params, _only_tp1(lambda c: _params(c, ln_f=False)))
    no_block_ln = attempt(L.check_rank_params, _only_tp1(lambda c: _params(c) - 4 * c.d_model * c.n_layers))
    assert "two LayerNorms (ln_1, ln_2)" in no_block_ln
    assert "the article's model" in attempt(L.check_rank_params, lambda c, tp: 59_340_288 if tp == 1 else 46_743_040)


def test_s1_rank_params_checker_explains_the_split(capsys):
    assert "not everything is split" in attempt(L.check_rank_params, lambda c, tp: _params(c) // tp)
    assert "are not split" in attempt(L.check_rank_params, lambda c, tp: _rank_params(c, tp, split_row_bias=True))
    assert "ARE split" in attempt(L.check_rank_params, lambda c, tp: _rank_params(c, tp, whole_col_bias=True))
    assert "that is the whole model" in attempt(L.check_rank_params, lambda c, tp: _params(c))
    capsys.readouterr()
    # Splitting every bias is right at TP=1 and wrong at TP=2, 3: partial credit.
    earned = score(L.check_rank_params, lambda c, tp: _rank_params(c, tp, split_row_bias=True), points=7)
    assert 0 < earned < 7 and "are not split" in capsys.readouterr().out
    # Cutting everything tp ways is right at the three TP=1 layouts of seven.
    assert score(L.check_rank_params, lambda c, tp: _params(c) / tp, points=7) == 3
    assert "not everything is split" in capsys.readouterr().out


def test_s1_the_article_counts_are_the_real_models():
    cfg = ModelConfig()
    counts = {sum(p.numel() for p in Transformer(cfg, seed=0, group=LocalGroup(0, tp)).parameters()) for tp in (1, 2)}
    assert L._article_counts() == counts


def test_c1_all_reduce_traffic_checker(capsys):
    def right(c, n, tp):
        return (0, 0) if tp == 1 else (2 * c.n_layers, n * c.d_model * _itemsize(c))

    assert L.check_all_reduce_traffic(right)
    assert L.check_all_reduce_traffic(stub) is False and "not attempted" in capsys.readouterr().out
    assert "two per layer" in attempt(L.check_all_reduce_traffic,
                                      lambda c, n, tp: (c.n_layers, n * c.d_model * _itemsize(c)))
    assert "OUTPUT" in attempt(L.check_all_reduce_traffic, lambda c, n, tp: (2 * c.n_layers, n * c.d_ffn * _itemsize(c)))
    assert "does not shrink" in attempt(L.check_all_reduce_traffic,
                                        lambda c, n, tp: (2 * c.n_layers, n * c.d_model * _itemsize(c) // tp))
    assert "bytes, not elements" in attempt(L.check_all_reduce_traffic, lambda c, n, tp: (2 * c.n_layers, n * c.d_model))
    assert "the article's model (8 layers)" in attempt(L.check_all_reduce_traffic,
                                                       lambda c, n, tp: (16, n * c.d_model * _itemsize(c)))
    # 4 bytes hard-coded: right in float32, and the bfloat16 case names the itemsize (not the FFN input)
    four = attempt(L.check_all_reduce_traffic, lambda c, n, tp: (0, 0) if tp == 1 else (2 * c.n_layers, n * c.d_model * 4))
    assert "2 bytes per element" in four and "OUTPUT" not in four
    capsys.readouterr()
    # Forgetting TP=1 is one case of five.
    earned = score(L.check_all_reduce_traffic, lambda c, n, tp: (2 * c.n_layers, n * c.d_model * _itemsize(c)), 5)
    assert earned == 4 and "nobody to add partial sums with" in capsys.readouterr().out


def test_time_forward_is_a_positive_time(tiny_cfg):
    model = Transformer(tiny_cfg, seed=0)
    assert L.time_forward(model, pack([torch.arange(5)]), repeats=2) > 0
    with pytest.raises(ValueError):
        L.time_forward(model, pack([torch.arange(5)]), repeats=0)
