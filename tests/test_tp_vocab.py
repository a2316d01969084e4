"""Groups' all-gather (core.groups), ranks as threads (tp.threads) and the vocab-parallel
embedding and LM head (tp.vocab, a vocabulary padded to a multiple of the TP size): TP=2 equals TP=1 by the tolerance rule."""
import math
import threading
from dataclasses import replace

import pytest
import torch

from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.tolerance import assert_close, max_abs_diff
from lessons_lib.tp.threads import tp_ranks_in_threads
from lessons_lib.tp.vocab import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size, vocab_parallel_logits, vocab_range
from lessons_lib.tp.workers import launch

V, D = 12, 5


def _table_ids_hidden(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g), torch.tensor([0, 11, 5, 6, 3, 3, 9]), torch.randn(7, D, generator=g)


def _layers(group, table):
    emb = VocabParallelEmbedding(V, D, group=group, dtype=table.dtype).load_full_(table)
    return emb, ParallelLMHead.tied_to(emb)


def vocab_worker(group, table, ids, hidden):
    """Run by spawned ranks (DistGroup over gloo): the embedding and the head of this rank."""
    emb, head = _layers(group, table)
    return emb(ids), head(hidden)


def test_local_group_all_gather_records_the_piece_with_the_gathered_shape():
    g = LocalGroup(1, 4)
    assert g.all_gather(torch.ones(3, 5), layer="z").shape == (3, 20)
    assert [(r.op, r.shape, r.rank, r.layer) for r in g.trace] == [("all_gather", (3, 5), 1, "z")]
    one = LocalGroup()
    assert one.all_gather(torch.ones(3, 5)).shape == (3, 5) and one.trace == []


def test_threaded_ranks_really_sum_and_gather_in_rank_order():
    outs = tp_ranks_in_threads(3, lambda g: g.all_reduce(torch.full((2, 2), float(g.rank + 1)), layer="x"))
    for out, trace in outs:
        assert torch.equal(out, torch.full((2, 2), 6.0)) and [r.layer for r in trace] == ["x"]
    outs = tp_ranks_in_threads(3, lambda g: g.all_gather(torch.full((2, 1), float(g.rank)), layer="y"))
    for out, trace in outs:
        assert torch.equal(out, torch.tensor([[0.0, 1.0, 2.0]] * 2))
        assert [(r.op, r.shape, r.layer) for r in trace] == [("all_gather", (2, 1), "y")]


def test_threaded_ranks_raise_the_root_cause_without_hanging():
    def fn(g):
        if g.rank == 1:
            raise KeyError("rank 1 broke")
        return g.all_reduce(torch.ones(1))
    t0 = threading.active_count()
    with pytest.raises(KeyError, match="rank 1 broke"):
        tp_ranks_in_threads(2, fn, timeout=5)
    assert threading.active_count() <= t0


def test_pad_vocab_size_rounds_up_to_a_multiple():
    for v in range(1, 200):
        for p in (1, 2, 3, 4, 8, 64):
            padded = pad_vocab_size(v, p)
            assert padded % p == 0 and v <= padded < v + p
    with pytest.raises(ValueError, match="pad_to must be a positive int, got 0"):
        pad_vocab_size(10, 0)


@pytest.mark.parametrize("v, tp", [(100, 4), (50257, 2), (77, 4), (5, 4), (12, 3)])
def test_vocab_range_gives_every_id_to_exactly_one_rank(v, tp):
    ranges = [vocab_range(v, r, tp) for r in range(tp)]
    owners = [r for r, (lo, hi) in enumerate(ranges) for _ in range(lo, hi)]
    assert owners == sorted(owners) and len(owners) == v          # contiguous, every id once, in rank order
    assert max(hi - lo for lo, hi in ranges) == math.ceil(v / tp)  # no rank holds more than its padded share
    for bad, match in (((v, tp, tp), f"rank must be an int in \\[0, {tp - 1}\\]"), ((v, 0, 0), "world_size must be a positive int"),
                       ((0, 0, tp), "vocab_size must be a positive int")):
        with pytest.raises(ValueError, match=match):
            vocab_range(bad[0], bad[1], bad[2])


@pytest.mark.parametrize("v, tp", [(13, 2), (5, 4), (77, 3)])
def test_a_vocabulary_that_does_not_divide_is_padded_and_still_equals_tp1(v, tp):
    """Each rank holds ceil(V / tp) rows (the padded ones zero); the head gathers ceil(V / tp) columns a rank
    and drops the padded ones: [T, V] like TP=1."""
    g = torch.Generator().manual_seed(v)
    table, hidden = torch.randn(v, D, generator=g), torch.randn(4, D, generator=g)
    ids = torch.tensor([0, v - 1, v // 2, 1])

    def layers(group):
        emb = VocabParallelEmbedding(v, D, group=group).load_full_(table)
        return emb, ParallelLMHead.tied_to(emb)
    emb64, head64 = (layer.double() for layer in layers(LocalGroup()))
    x64, y64 = emb64(ids), head64(hidden.double())
    outs = tp_ranks_in_threads(tp, lambda g: tuple(layer(x) for layer, x in zip(layers(g), (ids, hidden))))
    for (x, y), trace in outs:
        assert_close(x, table[ids], x64, f"embedding, V={v}, TP={tp}")
        assert y.shape == (4, v)
        assert_close(y, hidden @ table.T, y64, f"LM head, V={v}, TP={tp}")
        assert trace[-1].shape == (4, math.ceil(v / tp))
    emb = VocabParallelEmbedding(v, D, group=LocalGroup(tp - 1, tp)).load_full_(table)
    lo, hi = vocab_range(v, tp - 1, tp)
    assert emb.weight.shape == (math.ceil(v / tp), D) and torch.equal(emb.weight[:hi - lo], table[lo:hi])
    assert not emb.weight[hi - lo:].any()                          # the padded rows are zeros


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_logits_on_threads_equal_the_models_own(tp):
    """The model's forward with a vocab-parallel embedding and head (a vocabulary of 77: padded at TP=2 and 3)
    equals TP=1's ``compute_logits(model(batch))``; its collectives: wte, the blocks' two a layer, lm_head."""
    cfg = ModelConfig(n_layers=2, d_model=24, n_heads=6, d_head=4, d_ffn=48, vocab_size=77, max_position=16)
    weights = init_weights(cfg, 0)
    batch = pack([[1, 76, 5], [40, 2]])
    whole = Transformer(cfg, weights)
    want = whole.compute_logits(whole(batch))
    twin = Transformer(replace(cfg, dtype=torch.float64), {n: w.double() for n, w in weights.items()})
    ref = twin.compute_logits(twin(batch))
    outs = tp_ranks_in_threads(tp, lambda g: vocab_parallel_logits(Transformer(cfg, weights, group=g), batch))
    for logits, trace in outs:
        assert_close(logits, want, ref, f"vocab-parallel logits, TP={tp}")
        assert [r.layer for r in trace][0] == "wte" and [r.layer for r in trace][-1] == "lm_head"
        assert len(trace) == 2 + cfg.all_reduces_per_forward
    with pytest.raises(ValueError, match="input_ids must be in"):
        vocab_parallel_logits(whole, pack([[77]]))
    with pytest.raises(ValueError, match="whole prompts only"):
        vocab_parallel_logits(whole, pack([[1, 2]], num_computed_tokens=[3]))


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_vocab_layers_on_threads_equal_tp1(tp):
    table, ids, hidden = _table_ids_hidden()
    emb1, head1 = _layers(LocalGroup(), table)
    emb64, head64 = _layers(LocalGroup(), table.double())
    x1, x64, y1, y64 = emb1(ids), emb64(ids), head1(hidden), head64(hidden.double())
    assert torch.equal(x1, table[ids]) and torch.equal(y1, hidden @ table.T)  # TP=1 is the plain layers
    outs = tp_ranks_in_threads(tp, lambda g: tuple(layer(x) for layer, x in zip(_layers(g, table), (ids, hidden))))
    for (x, y), trace in outs:
        assert_close(x, x1, x64, f"embedding, TP={tp}")
        assert_close(y, y1, y64, f"LM head, TP={tp}")
        assert [(r.op, r.layer, r.shape) for r in trace] == [("all_reduce", "wte", (7, D)),
                                                               ("all_gather", "lm_head", (7, V // tp))]


def test_a_rank_alone_misses_the_other_ranks_rows_and_logits():
    """The collectives are what makes TP=2 equal TP=1: a stand-in rank (no exchange) is wrong."""
    table, ids, hidden = _table_ids_hidden()
    emb, head = _layers(LocalGroup(0, 2), table)
    assert max_abs_diff(emb(ids), table[ids]) > 0.1 and max_abs_diff(head(hidden), hidden @ table.T) > 0.1
    assert emb.weight.shape == (V // 2, D) and head.weight is emb.weight


def test_tp2_vocab_layers_on_spawned_ranks_equal_tp1():
    """DistGroup.all_gather over torch.distributed (gloo, two processes)."""
    table, ids, hidden = _table_ids_hidden(1)
    emb64, head64 = _layers(LocalGroup(), table.double())
    x64, y64 = emb64(ids), head64(hidden.double())
    res = launch(vocab_worker, world_size=2, backend="gloo", timeout=120, args=(table, ids, hidden), verbose=False)
    for (x, y), trace in zip(res.results, res.traces):
        assert_close(x, table[ids], x64, "embedding, TP=2 on processes")
        assert_close(y, hidden @ table.T, y64, "LM head, TP=2 on processes")
        assert [(r.op, r.layer, r.shape) for r in trace] == [("all_reduce", "wte", (7, D)),
                                                               ("all_gather", "lm_head", (7, V // 2))]
