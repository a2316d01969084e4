"""Lesson 00's module: the figures, the alpha-beta model of the all-reduces and its explorer, the notebook's helpers and the exercise checkers."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
from helpers import FakeBench, attempt, by_class, gids, png_of, stub

from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer
from lessons_lib.course import l00_setup as L
from lessons_lib.course.grading import score
from lessons_lib.measure.comm import NVLINK, AlphaBeta, comm_cost_state, measure_point, packing_saving
from lessons_lib.tp.plan import rank_params, smallest_tp, tp_sizes


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


def test_c1_allreduce_growth_draws_the_payload_and_the_ring_traffic(tiny_cfg):
    fig = L.allreduce_growth(tiny_cfg, tokens=[1, 10, 100, 1000])
    assert {"ring-2", "ring-4", "ring-8"} <= set(gids(fig))
    left, right = fig.axes
    count = 2 * tiny_cfg.n_layers
    assert list(left.get_lines()[0].get_ydata()) == [n * tiny_cfg.d_model * 4 for n in (1, 10, 100, 1000)]
    rings = {ln.get_gid(): ln for ln in right.get_lines() if (ln.get_gid() or "").startswith("ring-")}
    for p, line in rings.items():  # per forward, all ranks: count x 2(p-1) payloads
        w = int(p.split("-")[1])
        assert list(line.get_ydata()) == [count * 2 * (w - 1) * n * tiny_cfg.d_model * 4 for n in (1, 10, 100, 1000)]
    assert rings["ring-2"].get_linewidth() > rings["ring-4"].get_linewidth()
    assert f"{count} all-reduces" in fig._suptitle.get_text()
    assert "per all-reduce" in left.get_title() and "per forward" in right.get_title()


def test_c1_alpha_beta_model_figure_draws_both_terms_and_each_dtypes_crossover():
    """The static picture before the measurement: the ring terms by hand, N* where they meet, twice as far in bf16."""
    alpha, beta = 5e-6, 450e9
    fig = L.alpha_beta_model()
    assert {"total-float32", "latency", "bandwidth-float32", "bandwidth-bfloat16", "crossover-float32",
            "crossover-bfloat16"} <= set(gids(fig))
    lines = {ln.get_gid(): ln for ln in fig.axes[0].get_lines()}
    ns = lines["latency"].get_xdata()
    assert list(lines["latency"].get_ydata()) == pytest.approx([2 * alpha * 1e6] * len(ns))  # 2(p-1) alpha, p = 2
    for dt, item in (("float32", 4), ("bfloat16", 2)):
        assert list(lines[f"bandwidth-{dt}"].get_ydata()) == pytest.approx([n * 512 * item / beta * 1e6 for n in ns])
    for dt in ("float32", "bfloat16"):  # each dtype's total: the same latency plus its own bandwidth term
        total = [a + b for a, b in zip(lines["latency"].get_ydata(), lines[f"bandwidth-{dt}"].get_ydata())]
        assert list(lines[f"total-{dt}"].get_ydata()) == pytest.approx(total)
        assert lines[f"total-{dt}"].get_color() == L.COMM and lines[f"crossover-{dt}"].get_color() == L.TEXT
    star32 = lines["crossover-float32"].get_xdata()[0]
    star16 = lines["crossover-bfloat16"].get_xdata()[0]
    assert star32 == pytest.approx(2 * alpha * beta / (512 * 4)) and star16 == pytest.approx(2 * star32)
    assert "A model, not a measurement" in fig._suptitle.get_text() and "beta = 450 GB/s" in fig._suptitle.get_text()
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "N* = 2,197 tokens" in texts and "N* = 4,395 tokens" in texts


def test_course_map_minutes_are_the_lessons_own():
    """The map in lesson 00 states each lesson's time as the lesson itself states it."""
    stated = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")):
        head = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells[:3] if c.cell_type == "markdown")
        minutes = [int(m) for m in re.findall(r"[Aa]bout (\d+) minutes", head)]
        stated[path.name[:2]] = minutes[-1] if minutes else None
    assert {num: minutes for num, *_, minutes in L.LESSONS} == stated


def test_course_total_time_in_lesson_00_is_the_maps_sum():
    """Lesson 00 says 'the whole course about 8 hours': the map's minutes add up to that, to a quarter hour."""
    path = Path(__file__).resolve().parents[1] / "notebooks" / "00_setup_one_request.ipynb"
    head = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells[:3])
    assert "the whole course about 8 hours" in head
    assert abs(sum(minutes for *_, minutes in L.LESSONS) / 60 - 8) <= 0.25


# ---- the alpha-beta model of the all-reduces and its explorer ---------------------------------------

def _ring(alpha, beta, payload, p):
    """The ring model written out on its own: 2(p-1) steps, each alpha + (S/p)/beta."""
    return 2 * (p - 1) * (alpha + payload / p / beta)


def test_comm_cost_figure_draws_the_terms_the_crossover_and_the_measured_points():
    s = comm_cost_state(64, AlphaBeta(80e-6, 2e9), requests=4)
    measured = {"tokens": [1, 16], "bytes": [2048, 32768], "seconds": [2e-4, 3e-4], "backend": "gloo", "world_size": 2}
    fig = L.comm_cost_figure(s, measured)
    assert {"model", "latency", "bandwidth", "crossover", "mark", "measured", "bar-latency-1"} <= set(gids(fig))
    left = fig.axes[0]
    dots = next(ln for ln in left.get_lines() if ln.get_gid() == "measured")
    assert list(dots.get_xdata()) == [1, 16] and list(dots.get_ydata()) == [1e3 * 16 * 2e-4, 1e3 * 16 * 3e-4]  # ms
    assert "measured" not in gids(L.comm_cost_figure(s))


def test_c1_comm_cost_state_says_when_a_fit_is_carried_to_another_tp_size():
    fit = AlphaBeta(80e-6, 2e9, "fitted")
    same, other = comm_cost_state(64, fit, world_size=2, fitted_world_size=2), comm_cost_state(64, fit, world_size=4,
                                                                                                   fitted_world_size=2)
    assert same["extrapolated"] is None and other["extrapolated"] == 2
    assert "extrapolated" not in L.comm_cost_text(same)
    assert "extrapolated: alpha and beta were fitted to a ring of 2 ranks, not measured at TP=4" in L.comm_cost_text(other)
    assert comm_cost_state(64, fit, world_size=4)["extrapolated"] is None  # a preset link: no fit to carry
    assert other["forward_s"] == comm_cost_state(64, fit, world_size=4)["forward_s"]  # a label, not another model


def test_comm_cost_explorer_callbacks_follow_every_control():
    measured = {"tokens": [1, 16], "bytes": [2048, 32768], "seconds": [2e-4, 3e-4], "backend": "gloo", "world_size": 2}
    here = AlphaBeta(80e-6, 2e9, "fitted")
    box = L.comm_cost_explorer(measured, here, num_tokens=64)
    w = by_class(box)
    assert {"abx-tokens", "abx-requests", "abx-d-model", "abx-dtype", "abx-layers", "abx-tp", "abx-network",
            "abx-measure", "abx-measured", "abx-text", "abx-figure"} <= set(w)
    assert "alpha = 80 us per step, beta = 2 GB/s" in w["abx-text"].value
    for name, value in (("abx-tokens", 5000), ("abx-requests", 8), ("abx-d-model", 4096), ("abx-dtype", "bfloat16"),
                        ("abx-layers", 80), ("abx-tp", 4), ("abx-network", NVLINK)):
        before, png = w["abx-text"].value, png_of(w["abx-figure"])
        w[name].value = value
        assert w["abx-text"].value != before and png_of(w["abx-figure"]) != png, name
    assert "450 GB/s" in w["abx-text"].value and "160 all-reduces" in w["abx-text"].value
    assert "ring, TP=4" in w["abx-text"].value and "extrapolated" not in w["abx-text"].value  # NVLink: a preset
    w["abx-network"].value = here
    assert "fitted to a ring of 2 ranks, not measured at TP=4" in w["abx-text"].value
    w["abx-measure"].click()  # no bench given: it says so instead of failing
    assert "no ranks to measure on" in w["abx-measured"].value
    assert "not recorded: the recorder runs up to 256 tokens" in w["abx-recorded"].value  # 5,000 tokens
    w["abx-tokens"].value, w["abx-layers"].value = 40, 8  # every move records: 8 requests of 5 tokens, TP = 4, 8 layers
    assert ("8 request(s) of 5 packed: 16 all-reduces of [40, 64] | one forward each: 128 all-reduces of [5, 64]"
            in w["abx-recorded"].value), w["abx-recorded"].value
    w["abx-tokens"].value = 3
    assert "requests must be at most num_tokens" in w["abx-text"].value


# ---- helpers the notebook calls ---------------------------------------------------------------------

# ---- exercise checkers --------------------------------------------------------------------------------

def _rank_params(cfg, tp, vp=False, split_row_bias=False, whole_col_bias=False, wpe_cut=False, all_cut=False):
    """Rank 0's parameters written out by hand (the tests' own count, independent of the checker's)."""
    d, k, f, n = cfg.d_model, cfg.qkv_dim, cfg.d_ffn, cfg.n_layers
    wte = (-(-cfg.vocab_size // tp) if vp else cfg.vocab_size) * d
    wpe = cfg.max_position * d // (tp if wpe_cut and vp else 1)
    whole = wte + wpe + n * 4 * d + 2 * d + (0 if split_row_bias else n * 2 * d) + (n * (3 * k + f) if whole_col_bias else 0)
    cut = n * (3 * k * d + k * d + f * d + d * f) + (n * 2 * d if split_row_bias else 0) + (0 if whole_col_bias else n * (3 * k + f))
    if all_cut:
        return (cfg.vocab_size * d + cfg.max_position * d + n * (4 * d + 2 * d) + 2 * d + cut) / tp
    return whole + cut // tp


def _plan(count):
    def fn(cfg, budget):
        sizes = [t for t in range(1, cfg.n_heads + 1) if cfg.n_heads % t == 0 and cfg.d_ffn % t == 0]
        return next(((t, vp) for t in sizes for vp in (False, True) if count(cfg, t, vp) <= budget), None)
    return fn


def test_s1_rank_params_is_the_real_shard_and_the_hand_count(tiny_cfg):
    for cfg in L._SMALL_CFGS:
        for tp in tp_sizes(cfg):
            real = sum(p.numel() for p in Transformer(cfg, seed=0, group=LocalGroup(0, tp)).parameters())
            assert rank_params(cfg, tp) == real == _rank_params(cfg, tp)
            assert rank_params(cfg, tp, True) == _rank_params(cfg, tp, vp=True)
    assert tp_sizes(L._SMALL_CFGS[1]) == [1, 2, 3, 6]
    with pytest.raises(ValueError, match="budget"):
        smallest_tp(tiny_cfg, 0)


def test_s1_tp_plan_checker_explains_wrong_answers(capsys):
    assert L.check_tp_plan(_plan(_rank_params))
    assert L.check_tp_plan(stub) is False and "not attempted" in capsys.readouterr().out
    everything = attempt(L.check_tp_plan, _plan(lambda c, t, v: _rank_params(c, t, all_cut=True)))
    assert "not everything is split" in everything and "rank 0 holds" in everything
    assert "no plan fits" in attempt(L.check_tp_plan, lambda c, b: L.tp_plan(c, b) or (4, True))
    never_cut = attempt(L.check_tp_plan, _plan(lambda c, t, v: _rank_params(c, t) if not v else float("inf")))
    assert "the vocab-parallel embedding is yours to choose" in never_cut and "already fits" in never_cut
    always_cut = attempt(L.check_tp_plan, _plan(lambda c, t, v: _rank_params(c, t, vp=True) if v else float("inf")))
    assert "buys nothing and adds collectives" in always_cut
    assert "the position table wpe stays whole" in attempt(
        L.check_tp_plan, _plan(lambda c, t, v: _rank_params(c, t, vp=v, wpe_cut=True)))
    assert "must divide n_heads" in attempt(L.check_tp_plan, lambda c, b: (5, False))
    assert "return a pair" in attempt(L.check_tp_plan, lambda c, b: 2)
    capsys.readouterr()
    earned = score(L.check_tp_plan, _plan(lambda c, t, v: _rank_params(c, t, all_cut=True)), points=8)
    assert 0 < earned < 8
    assert L.tp_plan(ModelConfig(), 40_000_000) == (2, True) and smallest_tp(ModelConfig(), 40_000_000) == 8


def _factor(fit, n, k, t, p, p_used=None):
    if p == 1:
        return None
    q = p if p_used is None else p_used
    u = n * 512 * 4 / (q * fit.alpha_s * fit.beta)
    return u * k * (t - 1) / (k - t)


def test_c1_packing_factor_checker(capsys):
    assert L.check_packing_factor(_factor)
    assert L.check_packing_factor(stub) is False and "not attempted" in capsys.readouterr().out
    fixed_p = attempt(L.check_packing_factor, lambda f, n, k, t, p: _factor(f, n, k, t, p, p_used=2))
    assert "do not plug in p = 2" in fixed_p and "packing saves" in fixed_p
    no_p = attempt(L.check_packing_factor, lambda f, n, k, t, p: _factor(f, n, k, t, p, p_used=1))  # S / (alpha beta)
    assert "p = 2 is missing from the ratio" in no_p and "saves 2.75x, not 2x" in no_p
    upside = attempt(L.check_packing_factor, lambda f, n, k, t, p: None if p == 1 else 1 / _factor(f, n, k, t, p))
    assert "upside down" in upside
    assert "no all-reduce" in attempt(L.check_packing_factor, lambda f, n, k, t, p: _factor(f, n, k, t, max(p, 2)))
    assert "must be a positive number" in attempt(L.check_packing_factor, lambda f, n, k, t, p: -1.0)
    naive = attempt(L.check_packing_factor, lambda f, n, k, t, p: None if p == 1 else t / packing_saving(f, n, k, p))
    assert "depends only on u" in naive and "not like the saving itself" in naive  # a diagnosis, not only a number
    capsys.readouterr()
    earned = score(L.check_packing_factor, lambda f, n, k, t, p: _factor(f, n, k, t, p, p_used=2), points=7)
    assert 0 < earned < 7


def test_c1_measure_text_and_the_figure_show_the_measurement_beside_the_model():
    fit = AlphaBeta(80e-6, 2e9)
    point = measure_point(FakeBench(), 100, 512, fit)
    assert point["model_s"] == pytest.approx(_ring(80e-6, 2e9, 204_800, 2))
    assert "took 1,000.0 us" in L.measure_text(point) and "[100, 512] float32" in L.measure_text(point)
    assert "probe" in gids(L.comm_cost_figure(comm_cost_state(100, fit), probe=point))
    assert "probe" not in gids(L.comm_cost_figure(comm_cost_state(100, fit, world_size=4), probe=point))


def test_every_engine_source_lesson_00_promises_is_displayed():
    """show_source returns a Markdown object: only a cell's last expression is shown, so any other is display()ed."""
    path = Path(__file__).resolve().parents[1] / "notebooks" / "00_setup_one_request.ipynb"
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        lines = cell.source.strip().splitlines()
        for j, line in enumerate(lines):
            if line.startswith("show_source(") and j != len(lines) - 1:
                pytest.fail(f"cell {i}: {line!r} is not the cell's last expression: wrap it in display()")
