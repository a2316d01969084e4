"""``serve.recording``: each batch one forward of ``Engine`` under the op recorder, rows and cells read off what ran."""
import pytest
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import init_weights
from lessons_lib.serve.engine import batch_stats
from lessons_lib.serve.recording import (
    BatchRecord,
    record_batches,
    record_scale,
    record_scaled,
    record_served,
    recorded_totals,
)
from lessons_lib.serve.scheduler import Request, Scheduler

TINY = ModelConfig(n_layers=1, d_model=8, n_heads=1, d_head=8, d_ffn=16, vocab_size=97, max_position=256)
WEIGHTS = init_weights(TINY, 0)


def test_record_batches_reads_rows_and_cells_off_the_executed_ops():
    """A and B (10 and 30 tokens) as one forward per method, counted by hand: padded 2 x 30 rows and
    2 x 30^2 cells, masked 40 rows and 40^2 cells, varlen 40 rows and 10^2 + 30^2 cells."""
    reqs = [Request(0, list(range(10))), Request(1, list(range(30)))]
    got = {}
    for method in ("padded", "masked", "varlen"):
        outs, (rec,) = record_batches(TINY, WEIGHTS, method, [reqs], 64)
        assert sorted(o.request_id for o in outs) == [0, 1] and rec.request_ids == (0, 1)
        assert len(rec.linear_rows) == 4 * TINY.n_layers  # qkv, out proj, fc1, fc2 per block
        got[method] = (rec.rows, rec.cells)
    assert got == {"padded": (60, 1800), "masked": (40, 1600), "varlen": (40, 1000)}


def test_record_batches_refuses_a_batch_that_is_not_one_forward_and_rows_that_disagree():
    reqs = [Request(0, list(range(40))), Request(1, list(range(40)))]
    with pytest.raises(ValueError, match="not one"):
        record_batches(TINY, WEIGHTS, "varlen", [reqs], 64)
    odd = BatchRecord("varlen", (0,), (40, 41), 0, ())
    with pytest.raises(ValueError, match="different row counts"):
        _ = odd.rows


def test_recorded_rows_catch_a_padded_forward_that_skips_its_pad_rows(monkeypatch):
    from lessons_lib.core import model
    from lessons_lib.core.batch import pack

    def skipping(self, input_ids, attention_mask):
        mask = attention_mask.bool()
        flat = self.forward(pack([r[m] for r, m in zip(input_ids, mask)]))
        out = flat.new_zeros(*input_ids.shape, flat.shape[-1])
        out[mask] = flat
        return out
    monkeypatch.setattr(model.Transformer, "forward_padded", torch.no_grad()(skipping))
    reqs = [Request(0, list(range(10))), Request(1, list(range(30)))]
    _, (rec,) = record_batches(TINY, WEIGHTS, "padded", [reqs], 64)
    assert rec.rows == 40 != batch_stats(TINY, [10, 30], "padded").executed_rows


def test_record_scale_is_the_smallest_shrink_under_the_limit():
    assert record_scale(TINY, [10, 20], "varlen", 500) == 1                      # 100 + 400 cells fit
    assert record_scale(TINY, [100, 100], "masked", 10_000) == 2                 # 200^2 > 10,000 >= 100^2
    assert record_scale(TINY, [100, 100], "varlen", 10_000) == 2                 # 2 x 100^2 > 10,000 >= 2 x 50^2
    assert record_scale(TINY, [7], "varlen", 0) == 7                             # nothing fits: the longest


def test_recorded_totals_sum_the_records_and_flag_those_that_are_not_the_prediction():
    reqs = [Request(0, list(range(10))), Request(1, list(range(30)))]
    recorded = {m: [(record_batches(TINY, WEIGHTS, m, [reqs], 64)[1][0], 1)] for m in ("padded", "masked", "varlen")}
    got = recorded_totals(TINY, [10, 30], [[0, 1]], recorded)
    assert {m: (c["rows"], c["cells"], c["checked"], c["differs"]) for m, c in got.items()} == {
        "padded": (60, 1800, 1, []), "masked": (40, 1600, 1, []), "varlen": (40, 1000, 1, [])}
    assert got["padded"]["useful_rows"] == 40 and got["padded"]["useful_cells"] == 1000
    lie = {m: [(BatchRecord(m, (0, 1), (40,), 1000, ()), 1)] for m in recorded}   # varlen's counts for every method
    assert [m for m, c in recorded_totals(TINY, [10, 30], [[0, 1]], lie).items() if c["differs"]] == ["padded", "masked"]


def test_record_scaled_runs_the_batch_once_per_method_shrunk_alike_when_too_big():
    got = record_scaled(TINY, WEIGHTS, (10, 30), 64, 10_000)
    assert {m: (r.rows, r.cells, k) for m, (r, k) in got.items()} == {
        "padded": (60, 1800, 1), "masked": (40, 1600, 1), "varlen": (40, 1000, 1)}
    small = record_scaled(TINY, WEIGHTS, (10, 30), 64, 500)    # padded 1800 cells: k = 2 shrinks it to 2 x 15^2
    assert {m: (r.rows, r.cells, k) for m, (r, k) in small.items()} == {
        "padded": (30, 450, 2), "masked": (20, 400, 2), "varlen": (20, 250, 2)}


def test_record_served_reads_the_rows_of_every_forward_the_scheduler_formed():
    got = record_served(TINY, WEIGHTS, Scheduler(40, 256), [10, 30, 20, 5])
    assert got["served"] == [0, 1, 2, 3] and got["batches"] == [[0, 1], [2, 3]]
    assert got["rows"] == 2 * 30 + 2 * 20                          # padded: R x Lmax per forward
    assert record_served(TINY, WEIGHTS, Scheduler(40, 256), [10, 30, 20, 5], method="varlen")["rows"] == 65
