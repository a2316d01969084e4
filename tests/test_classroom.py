"""The classroom (tools/classroom.py, `make classroom` and `make grade`, with nbgrader).

On the fixture lesson tests/classroom_fixture/99_fixture.ipynb, always: the layout check, a release
without solution code that runs under nbval, and grading three submissions (the reference answers,
the untouched stubs, a typical wrong answer). On every real lesson in notebooks/: the same, where
the untouched release is the stub submission, so its autograded copy (executed by nbclient with
this venv's kernel) shows that the release runs top to bottom.

A lesson that does not follow the exercise layout yet, or an exercise without an entry in
WRONG_ANSWERS, fails under CI and is skipped (with the reason) elsewhere.
CLASSROOM_LESSONS=00,03 limits the real lessons graded here (the whole set takes a few minutes).
"""
from __future__ import annotations

import csv
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import classroom as C  # noqa: E402  # tools/ is no package: importable only after the sys.path line above

FIXTURE = ROOT / "tests" / "classroom_fixture" / "99_fixture.ipynb"
LESSONS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))

# A typical wrong answer per exercise, keyed by the grade cell's grade_id: code defining `wrong` (renamed to
# the exercise's answer function in the submission), and a phrase of the checker's explanation that the
# feedback must show. Each is right on some of the checker's cases, so it earns partial marks.
# Lesson writers: a new exercise needs an entry here (tests/test_classroom.py says which one is missing).
WRONG_ANSWERS: dict[str, tuple[str, str]] = {
    # the fixture; 99.1 also warns on an empty list, a case only the grade cell reaches: the warning on
    # stderr must not zero the grade (IgnorePattern in the generated nbgrader_config.py)
    "ex99_1_grade": ('''
import warnings

def wrong(xs):  # the last element is missing (and a leftover debugging warning)
    if not xs:
        warnings.warn("empty list")
    return sum(xs[:-1])
''', "the last element is missing"),
    "ex99_2_grade": ('''
def wrong(n):  # transposed: the future instead of the past
    import torch
    return torch.ones(n, n, dtype=torch.bool).triu()
''', "the mask is transposed"),
    # lesson 00
    "ex00_1_grade": ('''
def wrong(cfg, budget):  # every tensor cut tp_size ways (so the vocab-parallel cut never seems needed)
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    per_layer = (3 * k * d + 3 * k) + (k * d + d) + (f * d + f) + (d * f + d) + 4 * d
    total = cfg.vocab_size * d + cfg.max_position * d + cfg.n_layers * per_layer + 2 * d
    sizes = [t for t in range(1, cfg.n_heads + 1) if cfg.n_heads % t == 0 and cfg.d_ffn % t == 0]
    return next(((t, False) for t in sizes if total / t <= budget), None)
''', "not everything is split"),
    "ex00_2_grade": ('''
def wrong(fit, num_tokens, requests, target, world_size):  # p = 2 plugged in: right at TP=2 only
    if world_size == 1:
        return None
    u = num_tokens * 512 * 4 / (2 * fit.alpha_s * fit.beta)
    return u * requests * (target - 1) / (requests - target)
''', "do not plug in p = 2"),
    # lesson 01
    "ex01_1_grade": ('''
def wrong(seq_lens, bug, k):  # both neighbours of a moved boundary always go wrong
    return {k - 1, k}
''', "causal attention lets each row see only the rows before it"),
    "ex01_2_grade": ('''
def wrong(seq_lens, max_num_seqs):  # longest first, full groups: the remainder group gets the shortest
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    return [order[i:i + max_num_seqs] for i in range(0, len(order), max_num_seqs)]
''', "where you cut matters"),
    "ex01_3_grade": ('''
def wrong(ids, mask):  # assumes the pads are at the end of every request
    import torch
    lens = mask.sum(dim=1)
    flat = torch.cat([ids[b, :int(n)] for b, n in enumerate(lens)])
    positions = torch.cat([torch.arange(int(n)) for n in lens])
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return flat, positions, cu
''', "its mask has the pads on the LEFT"),
    # lesson 02
    "ex02_1_grade": ('''
def wrong(x, cu_seqlens, eps):  # plain BatchNorm: statistics over every token of the flat batch
    return (x - x.mean(dim=0, keepdim=True)) / (x.var(dim=0, unbiased=False, keepdim=True) + eps) ** 0.5
''', "statistics over ALL the tokens"),
    "ex02_2_grade": ('''
def wrong(suspect):  # reads the payload shape, never asks whether the ranks agree
    _, sent = suspect.run(torch.randn(3, suspect.in_features))
    if not sent[0]:
        return "no all-reduce"
    if sent[0][0].shape[1] != suspect.out_features:
        return "all-reduce before the matmul"
    at_zero, _ = suspect.run(torch.zeros(1, suspect.in_features))
    return "correct" if torch.allclose(at_zero[0][0], suspect.bias, atol=1e-5) else "bias on every rank"
''', "the sum came too early"),
    "ex02_3_grade": ('''
def wrong(x):  # one scale for the whole flat batch, recomputed at every forward (per-tensor dynamic)
    import torch
    s = x.abs().max() / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(x / s), -127, 127) * s
''', "sets every request's grid"),
    # lesson 03
    "ex03_1_grade": ('''
def wrong(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
    import torch  # right values, but a Python loop: matmuls grow with the requests
    out, cu = torch.empty_like(q), cu_seqlens_q.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (x[s:e].transpose(0, 1) for x in (q, k, v))
        scores = qi @ ki.transpose(1, 2) / q.shape[-1] ** 0.5
        future = torch.ones(e - s, e - s, dtype=torch.bool).triu(1)
        out[s:e] = (scores.masked_fill(future, float("-inf")).softmax(-1) @ vi).transpose(0, 1)
    return out
''', "one per request"),
    "ex03_2_grade": ('''
def wrong(rule, k):  # "unequal" refuted with two requests of ratio k: padding still wastes more
    return [1, k] if rule == "unequal" else [k] + [1] * (k - 1)
''', "padding still wastes more"),
    "ex03_3_grade": ('''
def wrong(cu_seqlens_q, cu_seqlens_k):  # same request, causal from the top-left: wrong with a cached prefix
    import torch
    def rows(cu):
        lens = (cu[1:] - cu[:-1]).long()
        request = torch.repeat_interleave(torch.arange(len(lens)), lens)
        return request, torch.arange(int(cu[-1])) - cu[:-1].long()[request]
    (req_q, pos_q), (req_k, pos_k) = rows(cu_seqlens_q), rows(cu_seqlens_k)
    return lambda q_idx, kv_idx: (req_q[q_idx] == req_k[kv_idx]) & (pos_k[kv_idx] <= pos_q[q_idx])
''', "top-left"),
    # lesson 04
    "ex04_1_grade": ('''
def wrong(cfg, seq_lens, tp):  # the LM head's logits summed over the ranks instead of gathered
    if tp == 1:
        return []
    t = sum(seq_lens)
    blocks = [("all_reduce", f"layers.{i}.{part}", (t, cfg.d_model))
              for i in range(cfg.n_layers) for part in ("attn.out_proj", "mlp.fc_down")]
    return [("all_reduce", "wte", (t, cfg.d_model))] + blocks + [("all_reduce", "lm_head", (t, cfg.vocab_size))]
''', "gather them (all_gather of [T, V/tp])"),
    "ex04_2_grade": ('''
def wrong(n_heads, n_kv_heads, d_head, n_layers, tp, bytes_per_number):  # n_kv_heads // tp: no replication
    per_rank = n_kv_heads // tp
    return ([list(range(r * per_rank, (r + 1) * per_rank)) for r in range(tp)],
            2 * per_rank * d_head * n_layers * bytes_per_number)
''', "must be REPLICATED"),
    "ex04_3_grade": ('''
def wrong(error, bias, allowed, tp):  # every error beyond the bound blamed on the heads: the bias row missed
    from lessons_lib.course import l04_tp as L
    return L.ENGINE_CUT if float(error.abs().max()) <= allowed else L.NAIVE_CUT
''', "the same row for every token"),
    "ex04_4_grade": ('''
def wrong(n_heads, d_head, n_layers, gpus, bytes_per_number, num_requests, tokens_per_request, budget_bytes):  # TP only
    fits = [kv for kv in range(1, n_heads + 1) if n_heads % kv == 0 and 2 * max(kv // gpus, 1) * d_head * n_layers
            * bytes_per_number * num_requests * tokens_per_request <= budget_bytes]
    return (max(fits), gpus, 1, 1) if fits else None
''', "got None, but 4 K/V heads fit"),
    # lesson 05
    "ex05_1_grade": ('''
def wrong(cfg, seq_lens, ridge):  # grouping taken to multiply prefill attention's intensity by the group, as in decode
    from lessons_lib.measure.flops import prefill_attention_intensity
    plain = prefill_attention_intensity(cfg, seq_lens, cfg.n_heads)
    fits = [kv for kv in range(1, cfg.n_heads + 1) if cfg.n_heads % kv == 0 and plain * cfg.n_heads / kv >= ridge]
    return max(fits, default=None)
''', "not by the group factor"),
    "ex05_2_grade": ('''
def wrong(total, n_kv_heads):  # equal requests, as many as stay compute-bound: no long request to carry it
    from lessons_lib.core.config import ModelConfig
    from lessons_lib.measure.flops import prefill_attention_intensity
    best = None
    for n in range(1, total // 16 + 1):
        lens = [total // n + (i < total % n) for i in range(n)]
        if prefill_attention_intensity(ModelConfig(), lens, n_kv_heads) < 989e12 / 4.8e12:
            break
        best = lens
    return best
''', "the long request carries the intensity"),
    "ex05_3_grade": ('''
def wrong(cfg, ridge, nbytes, kv_len):  # both parts timed by their bytes alone: the linear layers never compute-bound
    d, k, f = cfg.d_model, cfg.qkv_dim, cfg.d_ffn
    shapes = ((d, 3 * k), (k, d), (d, f), (f, d))
    w, a = sum(x * y for x, y in shapes), sum(x + y for x, y in shapes)
    per_request = 2 * k * (1 + kv_len)          # query, output, K and V cache
    return None if per_request <= a else w // (per_request - a) + 1
''', "compute-bound"),
    # lesson 06
    "ex06_1_grade": ('''
def wrong(self):  # shortest first, always: valid and pads less, but a long request starves
    batch, used = [], 0
    for r in sorted(self.waiting, key=len):
        if len(batch) < self.max_num_seqs and used + len(r) <= self.max_num_batched_tokens:
            batch.append(r)
            used += len(r)
    for r in batch:
        self.waiting.remove(r)
    return batch
''', "passed over"),
    "ex06_2_grade": ('''
def wrong():  # FCFS already groups these lengths well: sorting cannot pad less
    return [10, 10, 10, 100], 128
''', "did not pad fewer"),
    # lesson 07
    "ex07_1_grade": ('''
def wrong(len_q, len_k, tile_start, block_m, block_n, window):  # ignores L_k - L_q: the diagonal top-left aligned
    last_row = min(tile_start + block_m, len_q) - 1
    hi = min(len_k, last_row + 1)
    lo = 0 if window is None else max(0, tile_start - window + 1)
    return (0, 0) if last_row < tile_start or hi <= lo else (lo // block_n, -(-hi // block_n))
''', "bottom-right aligned"),
    "ex07_2_grade": ('''
def wrong(seq_lens, block_m):  # request r starts at floor(cu_r / BLOCK_M): no slot for a ragged last tile
    cu = [sum(seq_lens[:r]) for r in range(len(seq_lens))]
    first = [c // block_m for c in cu]
    out = []
    for i in range(sum(seq_lens) // block_m + len(seq_lens)):
        r = max(j for j in range(len(seq_lens)) if first[j] <= i)
        out.append((r, i - first[r]))
    return out
''', "floor(cu_r / BLOCK_M)"),
    "ex07_3_grade": ('''
def wrong(seq_lens, n_heads, n_sms):  # counts every program of the grid as a busy SM, the early exits too
    from lessons_lib.course import l07_kernel as L
    work = {bm: L.tile_work(seq_lens, n_heads, bm) for bm in L.TILE_SIZES}
    full = [bm for bm in work if work[bm].programs >= n_sms]
    if full:
        return min(full, key=lambda bm: (work[bm].kv_bytes_read(64, 2), work[bm].executed_cells))
    return max(work, key=lambda bm: work[bm].programs)
''', "return at once"),
    # lesson 08
    "ex08_1_grade": ('''
def wrong(seq_lens, max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold):  # a capped chunk ends the forward
    left, forwards = list(seq_lens), []
    cap = long_prefill_token_threshold or max_num_batched_tokens
    while any(left):
        fwd, room = [], max_num_batched_tokens
        for i, rest in enumerate(left):
            if not room or len(fwd) == max_num_seqs:
                break
            if rest:
                take = min(rest, cap, room)
                fwd.append((i, take))
                left[i] -= take
                room -= take
                if left[i]:
                    break
        forwards.append(fwd)
    return forwards
''', "a capped chunk does not end the forward"),
    "ex08_2_grade": ('''
def wrong(seq_lens, draft, max_budget, max_cache_rows, measure):  # the biggest budget: the fewest forwards, cache unchecked
    return max_budget
''', "Over the limit"),
    "ex08_3_grade": ('''
def wrong(num_computed_tokens, seq_lens):  # positions restart in every chunk, as for a whole prompt
    import torch
    return torch.cat([torch.arange(n) for n in seq_lens])
''', "restart at 0 in every chunk"),
}

STUDENTS = ("reference", "stub", "wrong")


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def not_ready(message: str):
    """A lesson (or an exercise) the classroom cannot handle yet: a failure under CI, a visible skip here."""
    if under_ci():
        pytest.fail(message)
    pytest.skip(message)


def wrong_answers(lesson: C.Lesson) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The wrong submission's answers (the reference where no wrong answer is defined) and the missing grade_ids."""
    answers, missing = C.reference_answers(lesson), []
    for e in lesson.exercises:
        if e.grade_id in WRONG_ANSWERS:
            answers[e.grade_id] = (WRONG_ANSWERS[e.grade_id][0], "wrong")
        else:
            missing.append(e.grade_id)
    return answers, missing


def write_submissions(build: Path, lessons: list[C.Lesson], folder: Path) -> None:
    """folder/<student>/<lesson>.ipynb for the three fake students, from the student release."""
    for lesson in lessons:
        released = C.read_notebook(build / "release" / lesson.name / lesson.path.name)
        for student, answers in zip(STUDENTS, (C.reference_answers(lesson), {}, wrong_answers(lesson)[0])):
            out = folder / student / lesson.path.name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(C.submission(released, lesson, answers), indent=1, ensure_ascii=False),
                           encoding="utf-8")


def code_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.split("\n")) if s and not s.startswith("#")}


def solution_bodies(source_nb: dict, lesson: C.Lesson) -> dict[str, set[str]]:
    """Per exercise, the code lines of its reference function and of its hidden tests that appear nowhere
    else in the lesson (this scan is the test's own, independent of the tool's)."""
    hidden = {i for e in lesson.exercises for i in (e.reference_index, e.grade_index)}
    elsewhere = set().union(*(code_lines(C.source(c)) for i, c in enumerate(source_nb["cells"]) if i not in hidden))
    out = {}
    for e in lesson.exercises:
        text = C.source(source_nb["cells"][e.reference_index]) + "\n" + C.source(source_nb["cells"][e.grade_index])
        out[e.number] = {x for x in code_lines(text) if "BEGIN" not in x and "END" not in x} - elsewhere
        assert out[e.number], f"exercise {e.number}: no reference line to look for"
    return out


def assert_no_solution(release_nb: dict, source_nb: dict, lesson: C.Lesson) -> None:
    student_text = "\n".join(C.source(c) for c in release_nb["cells"])
    for number, lines in solution_bodies(source_nb, lesson).items():
        shown = sorted(x for x in lines if x in student_text)
        assert not shown, f"{lesson.name} exercise {number}: the student notebook shows solution code {shown}"
    for e in lesson.exercises:
        assert not re.search(rf"\b{e.reference_name}\b", student_text), f"{e.reference_name} is named in the release"
    assert "BEGIN SOLUTION" not in student_text and "HIDDEN TESTS" not in student_text
    assert all(not c.get("outputs") for c in release_nb["cells"]), "the release carries outputs"


def assert_graded(grading: C.Grading, lesson: C.Lesson) -> None:
    """Reference: full marks; stubs: zero; wrong: partial marks with the checker's explanation in the feedback."""
    assert not [f for f in grading.failed if f[1] == lesson.name and f[0] in STUDENTS], grading.failed
    full = sum(e.points for e in lesson.exercises)
    ref, stub, wrong = (grading.of(s, lesson.name) for s in STUDENTS)
    for e in lesson.exercises:
        r, s = ref[e.grade_id], stub[e.grade_id]
        assert r.points == e.points, f"{e.grade_id}: the reference answer got {r.points} of {e.points}:\n{r.explanation}"
        assert s.points == 0, f"{e.grade_id}: the untouched stub got {s.points}:\n{s.explanation}"
        assert "not attempted" in s.explanation, s.explanation
        if e.grade_id in WRONG_ANSWERS:
            w, phrase = wrong[e.grade_id], WRONG_ANSWERS[e.grade_id][1]
            assert 0 < w.points < e.points, f"{e.grade_id}: the typical wrong answer got {w.points} of {e.points}:\n{w.explanation}"
            assert phrase in w.explanation, f"{e.grade_id}: the feedback lacks the checker's explanation {phrase!r}:\n{w.explanation}"
    assert sum(x.points for x in ref.values()) == full and sum(x.points for x in stub.values()) == 0
    build = grading.build
    for student in STUDENTS:
        fb = build / "feedback" / student / lesson.name
        assert (fb / f"{lesson.name}.html").is_file(), f"no HTML feedback for {student} / {lesson.name}"
        summary = (fb / f"{lesson.name}.txt").read_text(encoding="utf-8")
        assert summary.startswith(f"{lesson.name}, {student}: "), summary
        graded = C.read_notebook(build / "autograded" / student / lesson.name / lesson.path.name)
        for e in lesson.exercises:   # a grade cell's stderr scores 0: none may reach the graded notebook
            outs = graded["cells"][e.grade_index].get("outputs", [])
            assert not [o for o in outs if o.get("name") == "stderr" or o["output_type"] == "error"], (student, e.grade_id, outs)
    page = html.unescape((build / "feedback" / "wrong" / lesson.name / f"{lesson.name}.html").read_text(encoding="utf-8"))
    for e in lesson.exercises:
        if e.grade_id in WRONG_ANSWERS:
            assert WRONG_ANSWERS[e.grade_id][1] in page, f"{e.grade_id}: the HTML feedback lacks the explanation"
    with open(build / "scores.csv", encoding="utf-8") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    assert float(rows["reference"][lesson.name]) == full and float(rows["stub"][lesson.name]) == 0
    assert 0 < float(rows["wrong"][lesson.name]) < full


def assert_release_ran(grading: C.Grading, lesson: C.Lesson) -> None:
    """The untouched release (the stub submission) ran top to bottom: no error in any cell, every answer
    cell's checker said "not attempted"."""
    graded = C.read_notebook(grading.build / "autograded" / "stub" / lesson.name / lesson.path.name)
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(graded["cells"]) for o in c.get("outputs", [])
              if o["output_type"] == "error"]
    assert not errors, f"{lesson.name}: the student release fails in cells {errors}"
    for e in lesson.exercises:
        said = "".join(C.source({"source": o.get("text", "")}) for o in graded["cells"][e.answer_index]["outputs"])
        assert "not attempted yet" in said, f"{e.number}: the stub's checker said {said!r}"


# ---- the layout check and the helpers, without nbgrader runs ---------------------------------------------

def test_the_fixture_follows_the_layout():
    lesson = C.parse_lesson(FIXTURE)
    assert lesson.ok, lesson.problems
    assert [(e.number, e.answer_name, e.reference_name, e.grade_id, e.points) for e in lesson.exercises] == [
        ("99.1", "my_total", "reference_total", "ex99_1_grade", 2.0),
        ("99.2", "my_causal_mask", "reference_causal_mask", "ex99_2_grade", 3.0)]


def _fixture_variant(edit) -> list[str]:
    nb = C.read_notebook(FIXTURE)
    edit(nb["cells"])
    return C.parse_lesson(FIXTURE, nb).problems


def test_the_layout_check_says_what_is_wrong():
    def old_layout(cells):   # the stub, a reference tagged "solution" without nbgrader metadata, no grade cell
        for c in cells[7:10]:
            c["metadata"] = {}
        cells[8]["metadata"] = {"tags": ["solution"]}
        cells[8]["source"] = C.region(C.source(cells[8]), C.BEGIN_SOLUTION, C.END_SOLUTION)
        del cells[9]
    problems = _fixture_variant(old_layout)
    assert any("99.1: still in the old layout" in p for p in problems), problems

    def wrong_points(cells):
        cells[9]["metadata"]["nbgrader"]["points"] = 4
    assert any("points=2) differs from the cell's nbgrader points 4" in p for p in _fixture_variant(wrong_points))

    def unlocked(cells):
        cells[13]["metadata"]["nbgrader"]["locked"] = False
    assert any("99.2: the grade cell needs nbgrader metadata" in p for p in _fixture_variant(unlocked))

    def stray_marker(cells):
        cells[4]["source"] = "# BEGIN SOLUTION\n" + C.source(cells[4])
    assert any("'BEGIN SOLUTION' outside" in p for p in _fixture_variant(stray_marker))

    def no_score_import(cells):
        cells[1]["source"] = C.source(cells[1]).replace("from lessons_lib.course.grading import score", "")
    assert any("no cell imports it" in p for p in _fixture_variant(no_score_import))


def test_the_leak_scan_finds_a_reference_line():
    lesson = C.parse_lesson(FIXTURE)
    nb = C.read_notebook(FIXTURE)
    secrets = C.secret_lines(FIXTURE)
    assert "running += x" in secrets["99.1"] and "reference_total" in secrets["99.1"]
    assert "import torch" not in secrets["99.2"]          # in the setup cell: not a secret
    student = json.loads(json.dumps(nb))
    for e in lesson.exercises:
        student["cells"][e.reference_index]["source"] = C.CODE_STUB
        student["cells"][e.grade_index]["source"] = ""
    assert C.leaks(student, secrets) == []
    student["cells"][7]["source"] += "\n    running += x"
    assert C.leaks(student, secrets) == ["exercise 99.1: running += x"]


def test_a_submission_replaces_only_the_stub():
    stub = "def my_total(xs):\n    # your code here\n    raise NotImplementedError\n\nL.check_total(my_total);"
    code, name = WRONG_ANSWERS["ex99_1_grade"][0], "wrong"
    got = C.answer_source(stub, code, name, "my_total")
    assert "def my_total(xs):" in got and "raise NotImplementedError" not in got and "wrong" not in got
    assert got.rstrip().endswith("L.check_total(my_total);") and got.startswith("import warnings")
    lesson = C.parse_lesson(FIXTURE)
    ref = C.reference_answers(lesson)["ex99_1_grade"]
    assert "assert" not in ref[0] and ref[1] == "reference_total"


def test_collect_finds_renamed_and_nested_notebooks(tmp_path):
    subs = tmp_path / "downloads"
    (subs / "ada" / "lesson 99").mkdir(parents=True)
    (subs / "ada" / "lesson 99" / "99_fixture (1).ipynb").write_text("{}")
    (subs / "bob").mkdir()
    (subs / "bob" / "99_fixture.ipynb").write_text("{}")
    (subs / "bob" / "notes.ipynb").write_text("{}")
    (subs / "bob" / ".ipynb_checkpoints").mkdir()
    (subs / "bob" / ".ipynb_checkpoints" / "99_fixture-checkpoint.ipynb").write_text("{}")
    pairs, unmatched = C.collect(subs, tmp_path / "build", ["99_fixture", "01_flat_batch"])
    assert pairs == [("ada", "99_fixture"), ("bob", "99_fixture")]
    assert unmatched == [str(subs / "bob" / "notes.ipynb")]
    assert (tmp_path / "build" / "submitted" / "ada" / "99_fixture" / "99_fixture.ipynb").is_file()


# ---- the fixture, end to end -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):
    build = tmp_path_factory.mktemp("classroom") / "build"
    release = C.release([FIXTURE], build, echo=lambda *_: None)
    lesson = release.lessons[0]
    write_submissions(build, [lesson], build.parent / "submissions")
    broken = build.parent / "submissions" / "broken" / FIXTURE.name    # not a notebook: reported, the others graded
    broken.parent.mkdir()
    broken.write_text("{ this is not JSON", encoding="utf-8")
    grading = C.grade(build, build.parent / "submissions", echo=lambda *_: None)
    return release, grading, lesson


def test_the_fixture_release_has_no_solution_code(fixture_run):
    release, _, lesson = fixture_run
    released = C.read_notebook(release.notebook(lesson))
    assert_no_solution(released, C.read_notebook(FIXTURE), lesson)
    assert (release.build / "release" / lesson.name / "l99_fixture.py").is_file()   # its helper ships with it
    assert (release.build / "student-release.zip").is_file() and (release.build / "release" / "README.md").is_file()


def assert_keeps_the_rest(source: dict, released: dict, lesson: C.Lesson) -> None:
    """Every cell but the reference and grade cells reaches the student unchanged (narrative, claims,
    figures, widgets, the answer cells with their checkers); those two become the stub and an empty cell."""
    assert len(source["cells"]) == len(released["cells"])
    secret = {i: e for e in lesson.exercises for i in (e.reference_index, e.grade_index)}
    for i, (a, b) in enumerate(zip(source["cells"], released["cells"])):
        assert a["cell_type"] == b["cell_type"] and C.tags(a) == C.tags(b), f"{lesson.name} cell {i}"
        if i not in secret:
            assert C.source(a) == C.source(b), f"{lesson.name}: cell {i} changed in the release"
        elif i == secret[i].reference_index:
            assert C.source(b) == C.CODE_STUB and b["metadata"]["jupyter"]["source_hidden"]
        else:
            assert C.source(b).strip() == "" and b["metadata"]["nbgrader"]["points"] == secret[i].points


def test_the_fixture_release_keeps_everything_else(fixture_run):
    release, _, lesson = fixture_run
    assert_keeps_the_rest(C.read_notebook(FIXTURE), C.read_notebook(release.notebook(lesson)), lesson)


def test_the_fixture_release_runs_under_nbval(fixture_run):
    release, _, lesson = fixture_run
    (release.build / "pytest.ini").write_text("[pytest]\n")  # not the repo's configuration
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                           "--nbval-current-env", "--rootdir", str(release.build), str(release.notebook(lesson))],
                          cwd=release.build, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", proc.stdout) and " failed" not in proc.stdout


def test_the_fixture_is_graded(fixture_run):
    _, grading, lesson = fixture_run
    assert grading.unmatched == []
    assert [(student, name) for student, name, _ in grading.failed] == [("broken", lesson.name)]
    assert "nbgrader Autograde failed for 99_fixture / broken" in grading.failed[0][2]
    assert_graded(grading, lesson)
    assert_release_ran(grading, lesson)
    wrong = grading.of("wrong", lesson.name)
    assert (wrong["ex99_1_grade"].points, wrong["ex99_2_grade"].points) == (0.5, 0.75)
    with open(grading.build / "scores_by_exercise.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["student"] for r in rows} == set(STUDENTS)


# ---- the real lessons ----------------------------------------------------------------------------------------

def _selected() -> list[Path]:
    wanted = [x.strip() for x in os.environ.get("CLASSROOM_LESSONS", "").split(",") if x.strip()]
    return [p for p in LESSONS if not wanted or p.name.split("_", 1)[0] in wanted]


@pytest.fixture(scope="module")
def lessons_run(tmp_path_factory):
    """Release every selected lesson that follows the layout, then grade the three fake students on all of them."""
    build = tmp_path_factory.mktemp("classroom_lessons") / "build"
    lessons, errors = {}, {}
    for path in _selected():
        lesson = C.parse_lesson(path)
        if not lesson.ok:
            continue
        try:   # the lesson as released (its copy in build/source/): the notebook may be edited meanwhile
            lessons[lesson.name] = C.release([path], build, echo=lambda *_: None).lessons[0]
        except C.ClassroomError as exc:
            errors[lesson.name] = str(exc)
    grading = None
    if lessons:
        write_submissions(build, list(lessons.values()), build.parent / "submissions")
        grading = C.grade(build, build.parent / "submissions", echo=lambda *_: None)
    return lessons, errors, grading, build


def _lesson(lessons_run, path: Path) -> tuple[C.Lesson, C.Grading]:
    lessons, errors, grading, _ = lessons_run
    if path.stem in errors:
        pytest.fail(f"{path.stem}: make classroom failed:\n{errors[path.stem]}")
    if path.stem not in lessons:
        problems = C.parse_lesson(path).problems
        not_ready(f"{path.stem} does not follow the exercise layout yet:\n  " + "\n  ".join(problems))
    return lessons[path.stem], grading


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_follows_the_layout(path):
    lesson = C.parse_lesson(path)
    if not lesson.ok:
        not_ready(f"{path.stem} does not follow the exercise layout yet (tools/classroom.py docstring):\n  "
                  + "\n  ".join(lesson.problems))
    missing = wrong_answers(lesson)[1]
    if missing:
        not_ready(f"{path.stem}: no typical wrong answer for {', '.join(missing)}: add one to WRONG_ANSWERS in "
                  "tests/test_classroom.py (code defining `wrong`, and a phrase of the checker's explanation)")


def test_every_wrong_answer_belongs_to_an_exercise():
    grade_ids = {"ex99_1_grade", "ex99_2_grade"}
    for path in LESSONS:
        grade_ids |= {e.grade_id for e in C.parse_lesson(path).exercises}
    if all(C.parse_lesson(p).ok for p in LESSONS):
        stale = sorted(set(WRONG_ANSWERS) - grade_ids)
        assert not stale, f"WRONG_ANSWERS has entries for exercises that no lesson has (renumbered?): {stale}"


@pytest.mark.parametrize("path", _selected(), ids=[p.stem for p in _selected()])
def test_lesson_release_has_no_solution_code(lessons_run, path):
    lesson, _ = _lesson(lessons_run, path)
    released = C.read_notebook(lessons_run[3] / "release" / lesson.name / path.name)
    assert_no_solution(released, C.read_notebook(lesson.path), lesson)
    assert_keeps_the_rest(C.read_notebook(lesson.path), released, lesson)


@pytest.mark.parametrize("path", _selected(), ids=[p.stem for p in _selected()])
def test_lesson_release_runs_top_to_bottom(lessons_run, path):
    lesson, grading = _lesson(lessons_run, path)
    assert_release_ran(grading, lesson)


@pytest.mark.parametrize("path", _selected(), ids=[p.stem for p in _selected()])
def test_lesson_is_graded(lessons_run, path):
    lesson, grading = _lesson(lessons_run, path)
    assert_graded(grading, lesson)
