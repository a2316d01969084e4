"""Engine hooks lesson 04 calls: what a rank's layer 0 computes (tp.dryrun), the vocab-parallel trace (tp.vocab),
a tapped group and a module's error on thread ranks (tp.threads), packings of T tokens (serve.workloads)."""
import pytest
import torch

from lessons_lib import faults
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.serve.workloads import PACKING_PATTERNS, packing_lens
from lessons_lib.tp.dryrun import expected_trace, rank_layers, rank_partials
from lessons_lib.tp.threads import TapGroup, module_error_in_threads, tapped_forward
from lessons_lib.tp.vocab import pad_vocab_size, vocab_parallel_trace

SMALL = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_ffn=64, vocab_size=50, max_position=64)
OUT = "layers.0.attn.out_proj"


def _batch(lens, cfg=SMALL):
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(1))
    return pack(list(ids.split(lens)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_layers_shapes_follow_the_heads_a_rank_holds(tp):
    hl, f = SMALL.n_heads // tp * SMALL.d_head, SMALL.d_ffn // tp
    got = {r.name: r for r in rank_layers(SMALL, 7, 0, tp)}
    assert got["QKV"].y == (7, 3 * hl) and got["out proj"].x == (7, hl) and got["out proj"].y == (7, SMALL.d_model)
    assert got["FFN-up"].y == (7, f) and got["FFN-down"].products == f
    assert [r.name for r in rank_layers(SMALL, 7, 0, tp) if r.all_reduce] == (["out proj", "FFN-down"] if tp > 1 else [])


def test_rank_partials_add_up_to_the_one_rank_out_proj_without_bias():
    w, batch = init_weights(SMALL, seed=0), _batch([3, 5])
    whole = rank_partials(SMALL, w, batch, 1)[0]
    parts = rank_partials(SMALL, w, batch, 2)
    assert not torch.allclose(parts[0], whole, atol=1e-3)
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_vocab_parallel_trace_adds_the_embedding_and_gathers_the_head():
    trace = vocab_parallel_trace(SMALL, [3, 4], 2)
    assert (trace[0].op, trace[0].layer, tuple(trace[0].shape)) == ("all_reduce", "wte", (7, SMALL.d_model))
    assert (trace[-1].op, trace[-1].layer, tuple(trace[-1].shape)) == ("all_gather", "lm_head",
                                                                       (7, pad_vocab_size(SMALL.vocab_size, 2) // 2))
    assert [r.layer for r in trace[1:-1]] == [r.layer for r in expected_trace(SMALL, 7)]
    with pytest.raises(ValueError):
        vocab_parallel_trace(SMALL, [0], 2)


def test_tapped_forward_keeps_each_ranks_own_partial_sums_and_every_rank_ends_equal():
    w, batch = init_weights(SMALL, seed=0), _batch([4, 2])
    runs = tapped_forward([Transformer(SMALL, w, group=TapGroup(r, 2, OUT)) for r in range(2)], batch)
    want = rank_partials(SMALL, w, batch, 2)
    for (_, sent, trace), ref in zip(runs, want):
        torch.testing.assert_close(sent, ref, atol=1e-5, rtol=1e-5)
        assert [r.layer for r in trace] == [r.layer for r in expected_trace(SMALL, 6)]
    torch.testing.assert_close(runs[0][0], runs[1][0])
    with torch.no_grad():
        whole = Transformer(SMALL, w)(batch)
    torch.testing.assert_close(runs[0][0], whole, atol=1e-4, rtol=1e-4)


def test_module_error_in_threads_is_rounding_and_an_extra_bias_is_caught():
    w, batch = init_weights(SMALL, seed=0), _batch([5, 3])
    error, bias, allowed = module_error_in_threads(SMALL, w, batch, 2, OUT)
    assert float(error.abs().max()) <= allowed
    with faults.injected("row_parallel_bias_on_every_rank"):
        error, bias, allowed = module_error_in_threads(SMALL, w, batch, 2, OUT)
    assert float(error.abs().max()) > 10 * allowed
    torch.testing.assert_close(error, bias.double().expand_as(error), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pattern", PACKING_PATTERNS)
def test_packing_lens_cover_t_tokens_with_r_nonempty_requests(pattern):
    for t, r in ((40, 2), (40, 3), (7, 7), (160, 13)):
        lens = packing_lens(t, r, pattern)
        assert len(lens) == r and sum(lens) == t and min(lens) >= 1
    assert packing_lens(40, 2, "quarter first")[0] == 40 // 4 and packing_lens(40, 3, "one long")[0] == 40 // 2
    with pytest.raises(ValueError, match="pattern"):
        packing_lens(10, 2, "zigzag")
    with pytest.raises(ValueError, match="num_requests"):
        packing_lens(3, 4)
