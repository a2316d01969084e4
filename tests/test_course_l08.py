"""Lesson 08's module (lessons_lib/course/l08_chunked.py): a chunk's mask, the staircase and timeline
figures, waits, the engine runs behind the claims, the bugs of the break-it cells, the explorer and
the three exercise checkers (a chunking scheduler, a budget chosen with numbers, the fix of a bug report)."""
from __future__ import annotations

import itertools

import pytest
import torch
from helpers import attempt, by_class, gids, min_font, png_of, stub

from lessons_lib import ModelConfig, init_weights
from lessons_lib.core.attention import varlen_attention
from lessons_lib.course import l08_chunked as L
from lessons_lib.serve.chunk_costs import fewest_forwards_budget
from lessons_lib.serve.scheduler import plan_batches
from lessons_lib.serve.workloads import make_requests
from lessons_lib.style import MIN_FONT

SMALL = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=4096)


def chunk_fcfs(lens, budget, max_seqs):
    """FCFS chunked prefill written here, independently of the library."""
    left, out, head = list(lens), [], 0
    while head < len(left):
        fwd, room, i = [], budget, head
        while i < len(left) and room and len(fwd) < max_seqs:
            t = min(left[i], room)
            fwd.append((i, t))
            left[i] -= t
            room -= t
            if left[i]:
                break
            i += 1
        while head < len(left) and not left[head]:
            head += 1
        out.append(fwd)
    return out


# ---- a chunk's mask and cells ---------------------------------------------------------------------

def test_chunk_mask_is_bottom_right_over_every_key_so_far():
    m = L.chunk_mask(4, 4)
    assert m.shape == (4, 8)
    assert m.sum(1).tolist() == [5, 6, 7, 8]            # query 4 + i sees keys 0 .. 4 + i
    assert L.chunk_mask(0, 3).tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()


def test_chunk_rows_match_the_whole_attention_and_fail_with_a_top_left_mask():
    err, bound = L.chunk_rows_error(4, 4)
    assert err <= bound
    with L.broken("causal top-left"):
        err, bound = L.chunk_rows_error(4, 4)
    assert err > 100 * bound


def test_staircase_cells_count_rectangles_and_keep_the_causal_cells():
    c = L.staircase_cells([512, 512, 512, 240])
    assert c["computed"] == 512 * 512 + 512 * 1024 + 512 * 1536 + 240 * 1776
    assert c["allowed"] == 1776 * 1777 // 2
    assert c["masked"] == c["computed"] - c["allowed"]
    assert L.staircase_cells([10])["computed"] == 100
    assert L.chunk_spans([3, 4, 5]) == [(0, 3), (3, 4), (7, 5)]


def test_mask_text_marks_allowed_keys():
    text = L.mask_text(L.chunk_mask(2, 2), start=2)
    assert text.splitlines()[1:] == ["query   2: ###.", "query   3: ####"]


# ---- figures ---------------------------------------------------------------------------------------

def test_chunk_staircase_draws_every_chunk_its_cache_and_its_rectangle():
    fig = L.chunk_staircase([5, 5, 3])
    g = set(gids(fig))
    assert {"chunk-0", "chunk-1", "chunk-2", "cache-1", "cache-2", "cached-1", "diag-0", "masked-2", "rect-2"} <= g
    assert "cache-0" not in g and "cached-0" not in g        # the first chunk reads no cache
    assert "13 tokens in 3 chunks" in fig.axes[0].get_title()
    assert "computed" not in fig.axes[1].get_title()   # the counts are the reveal of a prediction (P4)
    assert min_font(fig) >= MIN_FONT


def test_chunk_timeline_marks_each_forward_and_where_the_requests_behind_finish():
    lens = [3, 10, 2, 2]
    runs = {"chunked": chunk_fcfs(lens, 4, 256), "whole": [[(0, 3)], [(1, 10), (2, 2), (3, 2)]]}
    fig = L.chunk_timeline(runs, lens, draft=1, behind=[2, 3])
    g = set(gids(fig))
    assert {"fwd-0-0", "fwd-1-1", "done-0-2", "done-1-3", "mean-0", "chunk-0-1-1"} <= g
    assert min_font(fig) >= MIN_FONT


def test_planned_timeline_is_the_engine_scheduler():
    lens = L.stream()[0]
    assert L.planned_timeline(lens, 512, True) == chunk_fcfs(lens, 512, 256)
    whole = L.planned_timeline(lens, 2048, False)
    assert [[i for i, _ in f] for f in whole] == plan_batches(lens, 2048)


# ---- the engine behind the claims ------------------------------------------------------------------

def test_refusal_is_the_engine_s_own_message():
    msg = L.refusal(SMALL)
    assert "request 9 has 1776 prompt tokens" in msg and "max_num_batched_tokens=512" in msg


def test_serve_chunked_equals_whole_and_records_the_staircase():
    prompts = [[t % SMALL.vocab_size for t in p] for p in ([1, 2, 3] * 4, [5] * 7)]
    ch = L.serve(prompts, 5, True, SMALL, record=True)
    wh = L.serve(prompts, 16, False, SMALL, record=True)
    assert L.timeline(ch["stats"]) == chunk_fcfs([12, 7], 5, 256)
    assert torch.allclose(L.stacked(ch, "last_hidden"), L.stacked(wh, "last_hidden"), atol=1e-5)
    assert L.same_argmax(ch, wh)
    counts = ch["recorder"].score_counts(SMALL.n_heads, SMALL.n_layers, wider_than=7)
    assert counts["cells"] == sum(s.cells_whole_computed for s in ch["stats"])
    assert counts["cells_wider"] == 5 * 10 + 2 * 12      # request 0's chunks of 5 after 5 and of 2 after 10
    assert wh["recorder"].score_counts(SMALL.n_heads, SMALL.n_layers)["cells"] == 12 * 12 + 7 * 7
    assert counts["cached_rows"] == sum(s.num_cached_tokens for s in ch["stats"]) > 0
    assert wh["recorder"].score_counts(SMALL.n_heads, SMALL.n_layers)["cached_rows"] == 0
    assert ch["kv_cache_peak_bytes"] > 0


@pytest.mark.parametrize("bug", ["bug report", "cache not appended", "causal top-left"])
def test_each_attention_bug_breaks_the_chunks_after_the_first(bug):
    prompt = [t % 512 for t in range(40, 1240)]          # 1,200 tokens: 3 chunks of the 512 budget
    assert "✗" not in L.chunk_error_table(prompt)
    with L.broken(bug):
        lines = L.chunk_error_table(prompt).splitlines()[1:]
    assert lines[0].endswith("✓") and all(line.endswith("✗") for line in lines[1:])
    assert "✗" not in L.chunk_error_table(prompt)       # undone after the block


def test_scheduler_bugs_break_the_budget_and_the_order():
    lens = [30, 20, 50]
    with L.broken("chunk takes a whole budget"):
        over = plan_batches(lens, 40, enable_chunked_prefill=True)
    assert max(sum(n for *_, n in f) for f in over) > 40
    with L.broken("chunked request to the back"):
        rr = plan_batches([100, 5], 40, enable_chunked_prefill=True)
    assert [i for i, *_ in rr[1]] == [1] or 1 in [i for i, *_ in rr[1]]  # request 1 passes the chunked request 0
    assert plan_batches([100, 5], 40, enable_chunked_prefill=True) == [[(0, 0, 40)], [(0, 40, 40)], [(0, 80, 20), (1, 0, 5)]]
    with pytest.raises(ValueError, match="unknown bug"):
        L.broken("no such bug")


def test_other_collectives_counts_what_is_not_a_block_all_reduce():
    from lessons_lib.core.groups import CollectiveRecord
    rec = [CollectiveRecord("all_reduce", (7, 512), "float32", 7 * 2048, f"layers.{i}.attn.out_proj", 0, 2)
           for i in range(2)]
    assert L.other_collectives(rec) == 0
    assert L.other_collectives([CollectiveRecord("all_gather", (7, 4, 64), "float32", 0, "layers.0.attn.kv", 0, 2)]) == 1


def test_forward_prices_text_says_the_extra_forwards():
    cfg = ModelConfig()
    text = L.forward_prices_text(cfg, {"a": [512, 512, 100], "b": [1124]}, 16, 40)
    assert "2 extra forwards, 32 extra all-reduces" in text and "-bound by" in text


# ---- the explorer ----------------------------------------------------------------------------------

def test_chunked_plan_state_is_the_engine_s_run():
    s = L.chunked_plan_state("long-tail", 24, 512)
    assert s["seq_lens"] == L.stream()[0] and s["longest"] == L.draft_index() == 9
    assert s["chunked"]["timeline"] == L.planned_timeline(s["seq_lens"], 512, True)
    assert s["whole_budget"] == 2048 and s["whole"]["max_forward"] == 2047
    assert s["chunked"]["max_forward"] <= 512 and s["chunked"]["kv_cache_peak_bytes"] > 0
    assert s["chunked"]["cells_causal"] == s["whole"]["cells_causal"] == s["chunked"]["cells_causal_masks"]
    top_left = L.chunked_plan_state("long-tail", 24, 512, bug="causal top-left")   # the masks drop, the schedule not
    assert top_left["chunked"]["cells_causal"] == s["chunked"]["cells_causal"]
    assert top_left["chunked"]["cells_causal_masks"] < s["chunked"]["cells_causal_masks"]
    assert f"bug on): {top_left['chunked']['cells_causal_masks']:,}" in L.chunked_plan_html(top_left)
    other = L.chunked_plan_state("long-tail", 24, 256)
    assert len(other["chunked"]["timeline"]) > len(s["chunked"]["timeline"])
    with pytest.raises(ValueError, match="workload"):
        L.chunked_plan_state("nope")
    with pytest.raises(ValueError, match="bug must be one of"):
        L.chunked_plan_state(bug="positions")


def test_chunked_plan_state_errors_come_from_the_engine_and_jump_with_a_bug():
    s = L.chunked_plan_state("long-tail", 16, 512)
    assert sorted(s["errors"]) == [2, 9] and s["chunks"] == {2: 2, 9: 5}
    assert all(e <= b for e, b in s["errors"].values())
    # the draft's error, independently: the same prompts served chunked and whole on the explorer's model
    prompts = make_requests(s["seq_lens"], L.EXPLORE_RUN_CFG.vocab_size, seed=1)   # lesson 06's prompt seed
    w = init_weights(L.EXPLORE_RUN_CFG, 0)
    ch = L.serve(prompts, 512, True, L.EXPLORE_RUN_CFG, w, compute_logits=False)
    fp64 = L.serve(prompts, 2048, False, L.EXPLORE_RUN_CFG, w, compute_logits=False, requests=[9], dtype=torch.float64)
    err = (ch["outputs"][9].last_hidden.double() - fp64["outputs"][9].last_hidden).abs().max().item()
    assert err == pytest.approx(s["errors"][9][0], rel=1e-3, abs=1e-9) and err > 0
    broken = L.chunked_plan_state("long-tail", 16, 512, bug="cache not appended")
    assert all(e > 100 * b for e, b in broken["errors"].values())
    assert "2 of 2 wrong" in L.chunked_plan_html(broken) and "0 of 2 wrong" in L.chunked_plan_html(s)
    assert len(s["chunked"]["forward_ms"]) == len(s["chunked"]["timeline"])


def test_chunked_plan_explorer_output_changes_with_the_budget():
    box = L.chunked_plan_explorer("uniform", 6, 256)
    w = by_class(box)
    before, png = w["cpx-counts"].value, png_of(w["cpx-figure"])
    w["cpx-budget"].value = 128
    assert w["cpx-counts"].value != before and png_of(w["cpx-figure"]) != png
    assert "chunked (budget 128)" in w["cpx-counts"].value
    w["cpx-bug"].value = "causal top-left"
    assert "bug: causal top-left" in w["cpx-counts"].value



@pytest.mark.parametrize("workload, n", [("long-tail", 1), ("long-tail", 10), ("uniform", 32)])
def test_chunked_plan_explorer_draws_a_stream_whose_longest_request_is_the_last(workload, n):
    s = L.chunked_plan_state(workload, n, 512)
    assert s["longest"] == n - 1 and s["behind"] == []
    fig = L.chunk_timeline({"chunked": s["chunked"]["timeline"], "whole": s["whole"]["timeline"]},
                           s["seq_lens"], s["longest"], s["behind"])
    assert "mean-0" not in set(gids(fig))
    assert "no request arrived after the longest" in L.chunked_plan_html(s)
    assert ("smaller than the chunk budget" in L.chunked_plan_html(s)) == (s["whole_budget"] < 512)
    wide = L.chunked_plan_state(workload, n, 4096)   # a chunk budget above the whole run's power of two
    assert wide["whole_budget"] < 4096 and "smaller than the chunk budget" in L.chunked_plan_html(wide)
    w = by_class(L.chunked_plan_explorer(workload, n, 512))
    assert "no request arrived after the longest" in w["cpx-counts"].value and png_of(w["cpx-figure"])

# ---- exercise 08.2 ---------------------------------------------------------------------------------

def test_budget_prices_of_the_stream_are_the_scheduler_s():
    m = L.budget_prices(L.stream()[0], L.draft_index(), 512)
    # the draft (request 9) is the only request cut before its end at the last boundary: 214 + 3 x 512 rows held
    assert (m["forwards"], m["largest"], m["all_reduces"], m["cache_rows_held"]) == (8, 512, 8 * 16, 214 + 3 * 512)
    assert (m["held_by"], m["held_after"]) == (9, 4)
    assert round(m["wait_forwards"], 2) == 6.64
    assert "cache held" in L.budget_table([512, 768])


def _prices(lens, draft, budget):  # written from the rule (FCFS chunking fills every forward), not from the module
    ends = list(itertools.accumulate(lens))
    total, starts = ends[-1], [e - n for e, n in zip(ends, lens)]
    held = max((p - s for p in range(budget, total, budget) for s, e in zip(starts, ends) if s < p < e), default=0)
    behind = range(draft + 1, len(lens))
    wait = sum(min(total, -(-ends[i] // budget) * budget) for i in behind) / len(behind)
    return -(-total // budget), held, wait


def _budget(lens, draft, top, cap, measure):
    fits = [b for b in range(16, top + 1, 16) if _prices(lens, draft, b)[1] <= cap]
    return min(fits, key=lambda b: (_prices(lens, draft, b)[0], _prices(lens, draft, b)[2], b))


def _best(lens, draft, top, cap):
    return fewest_forwards_budget(lens, range(draft + 1, len(lens)), top, cap, 16)


def test_budget_prices_are_the_engine_s_forwards():
    lens, d = L.stream()[0], L.draft_index()
    for b in (432, 480, 512, 656, 720, 768):
        p = L.budget_prices(lens, d, b)
        assert (p["forwards"], p["cache_rows_held"]) == _prices(lens, d, b)[:2]
        assert p["wait_tokens"] == pytest.approx(_prices(lens, d, b)[2])
    for top, cap in ((768, 1400), (512, 1600), (768, 2000)):
        assert _best(lens, d, top, cap) == _budget(lens, d, top, cap, None)
    assert _best(lens, d, 768, 1400) not in (512, 768)     # neither the lesson's budget nor the biggest
    with pytest.raises(ValueError, match="no budget up to 256"):
        _best([90, 700, 10, 10], 1, 256, 100)
    # the Engine itself runs the forwards and holds the rows the scheduler's plan says
    ran = L.budget_prices(lens, d, 720, engine=True)
    assert (ran["forwards"], ran["cache_rows_held"]) == _prices(lens, d, 720)[:2]


def test_budget_choice_checker_passes_a_design_and_explains_mistakes():
    assert L.check_budget_choice(_budget)
    assert "Over the limit" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: top)
    assert "extra forward" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: 432 if cap == 1400 else top)
    assert "shorter wait" in attempt(L.check_budget_choice,
                                     lambda s, d, top, cap, m: 656 if cap == 1400 else _budget(s, d, top, cap, m))
    assert "at most 3" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: [m(b) for b in (16, 32, 48, 64)][0])
    assert "switched off" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: _best(s, d, top, cap))
    assert "switched off" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: len(L.budget_table([top])))
    assert "expected an int" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: "720")
    assert "multiple of 16" in attempt(L.check_budget_choice, lambda s, d, top, cap, m: top + 1)
    # one forward from 48 tokens on, nothing held, the same wait: the tie goes to the smaller budget
    assert "smaller budget" in attempt(
        L.check_budget_choice, lambda s, d, top, cap, m: 64 if top == 64 else _budget(s, d, top, cap, m))
    assert L.check_budget_choice(_budget)   # the scheduler is back after a refused call
    assert L.planned_timeline([5, 3], 4, True) == [[(0, 4)], [(0, 1), (1, 3)]]


# ---- exercise 08.3 ---------------------------------------------------------------------------------

def _positions(done, lens):
    return torch.cat([torch.arange(c, c + n) for c, n in zip(done, lens)])


def test_bug_report_checker_passes_and_runs_the_engine():
    assert L.check_bug_report_fix(_positions)


def test_the_reported_bug_is_one_of_the_named_bugs_and_breaks_the_later_chunks():
    assert L.REPORTED_BUG in L.BUGS
    with L.reported_bug():
        table = L.chunk_error_table()
    lines = table.splitlines()[1:]
    assert lines[0].endswith("✓") and all(line.endswith("✗") for line in lines[1:]), table


@pytest.mark.parametrize("answer, hint", [
    (lambda done, lens: torch.cat([torch.arange(n) for n in lens]), "restart at 0 in every chunk"),
    (lambda done, lens: torch.arange(sum(lens)), "across the whole batch"),
    (lambda done, lens: _positions(done, lens) + 1, "off by one"),
    (lambda done, lens: _positions(done, lens).int(), "torch.int64"),
    (lambda done, lens: torch.cumsum(torch.tensor([0, *(c + n for c, n in zip(done, lens))]), 0), "that is cu_seqlens_k"),
    (lambda done, lens: torch.cumsum(torch.tensor([0, *lens]), 0), "that is cu_seqlens_q"),
    (lambda done, lens: torch.ones(sum(lens), sum(lens), dtype=torch.bool), "a mask"),
])
def test_bug_report_checker_explains_typical_mistakes(answer, hint):
    assert hint in attempt(L.check_bug_report_fix, answer)


def test_varlen_attention_of_a_chunk_reads_the_cache_rows():
    """The engine's attention with cu_seqlens_q != cu_seqlens_k, independently of the course module."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    whole = varlen_attention(q, k, v, cu)
    chunk = varlen_attention(q[2:], k, v, torch.tensor([0, 4], dtype=torch.int32), cu)
    assert torch.allclose(chunk, whole[2:], atol=1e-6)


# ---- the notebook's independent counts ------------------------------------------------------------

class _Stats:
    def __init__(self, chunks):
        self.chunks = chunks


def test_causal_cells_from_masks():
    stats = [_Stats([(0, 0, 4)]), _Stats([(0, 4, 4), (1, 0, 2)])]
    assert L.causal_cells_from_masks(stats) == 8 * 9 // 2 + 2 * 3 // 2


# ---- exercise 08.1: the chunk cap -------------------------------------------------------------------

def _capped(lens, budget, max_seqs, cap, stop_after_cap=False, ignore_seqs=False):
    left, forwards, limit = list(lens), [], cap or budget
    while any(left):
        fwd, room = [], budget
        for i, rest in enumerate(left):
            if not room or (len(fwd) == max_seqs and not ignore_seqs):
                break
            if rest:
                take = min(rest, limit, room)
                fwd.append((i, take))
                left[i] -= take
                room -= take
                if stop_after_cap and left[i]:
                    break
        forwards.append(fwd)
    return forwards


def test_capped_scheduler_checker_passes_and_the_cap_lets_the_questions_pass(capsys):
    assert L.check_capped_scheduler(stub) is False
    assert "not attempted" in capsys.readouterr().out
    assert L.check_capped_scheduler(_capped)
    assert L.capped_finish(_capped, 0)["before"] == 0
    assert L.capped_finish(_capped, 128)["before"] == 14
    # a cap at or above the budget is plain FCFS chunking, the engine scheduler's
    assert _capped(L.stream()[0], 512, 256, 512) == chunk_fcfs(L.stream()[0], 512, 256)
    # the engine's own cap (Scheduler(long_prefill_token_threshold=...)) serves the stream as the rule here does
    for cap in (0, 128):
        assert L.engine_capped_finish(cap) == L.capped_finish(_capped, cap)


@pytest.mark.parametrize("answer, hint", [
    (lambda lens, b, m, c: _capped(lens, b, m, c, stop_after_cap=True), "does not end the forward"),
    (lambda lens, b, m, c: _capped(lens, b, m, c, ignore_seqs=True), "the budget counts requests too"),
    (lambda lens, b, m, c: chunk_fcfs(lens, b, m), "no chunk may exceed the cap"),
    (lambda lens, b, m, c: _capped(lens, b, m, c or 1), "0 means no cap"),
    (lambda lens, b, m, c: [[i for i, _ in f] for f in _capped(lens, b, m, c)], "pair (request index"),
])
def test_capped_scheduler_checker_explains_typical_mistakes(answer, hint):
    assert hint in attempt(L.check_capped_scheduler, answer)


def test_intensity_table_marks_the_ridge():
    assert "ridge of 206 FLOP/byte" in L.intensity_table(ModelConfig(), [512])
