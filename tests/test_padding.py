"""measure.padding: padding's waste (whole blocks, causal triangles, whole tiles), where attention's waste passes
the pad rows', the fewest pad rows, a flat and padded run under the recorder, and a packer that moves a boundary."""
from __future__ import annotations

import math

import pytest
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.measure import padding
from lessons_lib.measure.flops import forward_flops

SMALL = ModelConfig(n_layers=2, vocab_size=1000, max_position=64)  # d = 512
TINY = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000, max_position=512)


def test_padding_waste_is_the_padded_forward_minus_the_request_alone():
    w = padding.padding_waste(SMALL, 30, 10)
    d, layers = SMALL.d_model, SMALL.n_layers
    assert w == {"linear": layers * 20 * 2 * 12 * d * d, "attention": layers * 4 * d * (30 ** 2 - 10 ** 2)}
    causal = padding.padding_waste(SMALL, 30, 10, causal=True)
    assert causal["attention"] == layers * 4 * d * (30 * 31 // 2 - 10 * 11 // 2) and causal["linear"] == w["linear"]
    with pytest.raises(ValueError, match="n must be <= pad_to"):
        padding.padding_waste(SMALL, 10, 30)


def test_whole_tiles_count_what_a_causal_tiled_kernel_executes():
    # one request of T = ceil(n / 128) tiles of rows executes T (T + 1) / 2 tiles of 128 x 128, counted by hand
    def tiles(n):
        t = math.ceil(n / 128)
        return t * (t + 1) // 2
    d, layers = SMALL.d_model, SMALL.n_layers
    for s, n in ((4000, 10), (300, 129), (256, 128)):
        w = padding.padding_waste(SMALL, s, n, block=128)
        assert w["attention"] == layers * 4 * d * 128 ** 2 * (tiles(s) - tiles(n)), (s, n)
        assert w["linear"] == padding.padding_waste(SMALL, s, n)["linear"]
    assert padding.padding_waste(SMALL, 4000, 3990, block=128)["attention"] == 0  # the same last row of tiles


def test_waste_crossover_where_s_plus_l_passes_6d_12d_and_whole_tiles():
    # whole blocks: S + L > 6 d; causal triangles: S + L > 12 d (4 d (S² - L²) vs 24 d² (S - L), halved)
    assert [padding.waste_crossover(TINY, s) for s in (30, 192, 193, 300, 384, 500)] == [None, None, 192, 85, 1, 1]
    assert padding.waste_crossover(SMALL, 4000, causal=True) == 12 * 512 - 4000
    assert padding.waste_crossover(SMALL, 2000) == 6 * 512 - 2000 + 1
    wins = padding.waste_wins(SMALL, 4000, block=128)
    assert padding.waste_crossover(SMALL, 4000, block=128) == wins[0]
    # whole tiles win earlier than the triangles, and never inside 4000's last row of tiles (3969..3999)
    assert wins[0] < 12 * 512 - 4000 and wins[-1] == 128 * (4000 // 128)
    assert padding.waste_wins(TINY, 300) == list(range(85, 300))


def test_fewest_pad_rows_by_brute_force():
    assert padding.pad_rows([10, 30]) == 20 and padding.pad_rows([]) == 0
    assert padding.fewest_pad_rows((100, 1, 1, 1), 3)[0] == 0
    assert padding.fewest_pad_rows((5, 30, 7, 29, 6, 31), 3)[0] == (31 * 3 - 90) + (7 * 3 - 18)
    best, split = padding.fewest_pad_rows((9, 2, 8, 3, 7), 2)
    assert sorted(i for g in split for i in g) == list(range(5)) and len(split) == 3
    assert best == sum(padding.pad_rows([(9, 2, 8, 3, 7)[i] for i in g]) for g in split)


def test_record_flat_and_padded_counts_what_the_model_executed():
    model = Transformer(TINY, seed=0)
    reqs = [torch.arange(3), torch.arange(17) % 50, torch.arange(5) + 7]
    run = padding.record_flat_and_padded(model, reqs)
    assert run["padded_shape"] == [3, 17] and run["rows"] == {"padded": 51, "flat": 25}
    assert run["cells"] == {"padded": 3 * 17 * 17, "flat": 9 + 289 + 25}
    for key, lens in (("flat", [3, 17, 5]), ("padded", [17] * 3)):
        want = forward_flops(TINY, lens)
        assert run["flops"][key] == {"linear": want.linear, "attention": want.attention}
    assert [len(o) for o in run["out"]["padded"]] == [3, 17, 5]
    left = padding.record_flat_and_padded(model, reqs, pad_to=20, side="left")
    assert left["padded_shape"] == [3, 20] and left["input_bytes"]["padded"] == 60 * 9


def test_broken_pack_moves_one_boundary_and_keeps_the_batch_consistent():
    reqs = [torch.arange(4), torch.arange(10, 16), torch.arange(20, 25)]
    late, early = padding.broken_pack(reqs, "late", 2), padding.broken_pack(reqs, "early", 1)
    assert late.cu_seqlens.tolist() == [0, 4, 11, 15] and late.positions.tolist()[10:12] == [6, 0]
    assert early.cu_seqlens.tolist() == [0, 3, 10, 15] and early.positions.tolist()[2:4] == [2, 0]
    assert torch.equal(late.input_ids, torch.cat(reqs))
    emptied = padding.broken_pack([torch.arange(1), torch.arange(3)], "early", 1)
    assert emptied.cu_seqlens.tolist() == [0, 0, 4] and emptied.seq_lens == [0, 4]
    for bug, k, match in (("sideways", 1, "bug must be one of"), ("late", 0, "inner boundary"), ("late", 3, "inner boundary")):
        with pytest.raises(ValueError, match=match):
            padding.broken_pack(reqs, bug, k)


def test_wrong_requests_follow_the_causal_argument():
    model = Transformer(TINY, seed=0)
    reqs = [torch.arange(6) + 1, torch.arange(4) + 20, torch.arange(5) + 40]
    assert padding.wrong_requests(model, reqs, "late", 1)[0] == {1}
    assert padding.wrong_requests(model, reqs, "early", 2)[0] == {1, 2}
    one = [torch.arange(1) + 3, torch.arange(4) + 20]
    assert padding.wrong_requests(model, one, "early", 1)[0] == {1}  # a one-token request is alone anyway
