"""tp.plan (what a rank's shard holds, read off the built model), measure.recorder.follow_request and
measure.report.machine_report."""
from __future__ import annotations

import torch

from lessons_lib import faults
from lessons_lib.core.batch import pack
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.recorder import follow_request
from lessons_lib.measure.report import backend_rows, format_table, machine_report
from lessons_lib.tp.plan import heads_held, row_spans, shard_table


def test_s1_shard_table_and_heads_held(tiny_cfg):
    weights = init_weights(tiny_cfg, 0)
    full = Transformer(tiny_cfg, weights)
    ranks = [Transformer(tiny_cfg, weights, group=LocalGroup(r, 2)) for r in (0, 1)]
    table = {name: (a, b, cut) for name, a, b, cut in shard_table(full, ranks[0])}
    assert table["attn.qkv.bias"] == ([3 * 64], [3 * 32], "split: output features")
    assert table["attn.out_proj.weight"] == ([64, 64], [64, 32], "split: input features")
    assert table["mlp.fc_down.bias"][2] == "whole (replicated)"
    assert heads_held(weights, ranks[0]) == {"Q": [0, 1], "K": [0, 1], "V": [0, 1]}
    assert heads_held(weights, ranks[1]) == {"Q": [2, 3], "K": [2, 3], "V": [2, 3]}
    assert "how" in format_table(shard_table(full, ranks[0]), ("p", "a", "b", "how"))


def test_s1_heads_held_sees_a_contiguous_qkv_cut(tiny_cfg):
    """The breakage of S1: a plain column cut of the fused weight gives rank 0 Q of every head."""
    weights = init_weights(tiny_cfg, 0)
    with faults.injected("qkv_sharded_as_one_block"):
        rank0 = Transformer(tiny_cfg, weights, group=LocalGroup(0, 2))
    assert heads_held(weights, rank0) == {"Q": [0, 1, 2, 3], "K": [0, 1], "V": []}


def test_s1_follow_request_records_the_pre_ln_order_and_removes_its_hooks(tiny_cfg):
    model = Transformer(tiny_cfg, seed=0)
    calls, blocks, out = follow_request(model, pack([torch.arange(7)]))
    assert [p for p, _ in calls] == ["ln_1", "attn.qkv", "attn.core", "attn.out_proj", "ln_2", "mlp.fc_up",
                                   "mlp.act", "mlp.fc_down"]
    assert dict(calls)["attn.qkv"] == [7, 3 * 64] and blocks == [[7, 64]] * tiny_cfg.n_layers
    assert torch.equal(out, model(pack([torch.arange(7)])))
    assert all(not m._forward_hooks for m in model.modules())
    with faults.injected("mlp_exact_gelu"):  # the MLP no longer calls its own GeLU module: the order shows it
        assert "mlp.act" not in dict(follow_request(model, pack([torch.arange(7)]))[0])


def test_machine_report_names_device_dtype_every_backend_and_the_tp_backend():
    report = machine_report(64)
    assert "device: " in report and "dtype: " in report
    for name in ("loop", "masked", "padded", "sdpa", "flex", "flash", "torch_varlen"):
        assert f"\n{name} " in report
    assert "TP=2 collectives: " in report
    rows = backend_rows("cpu", torch.float32, 64)
    assert {r[0]: r[1] for r in rows}["sdpa"] == "yes"


def test_s1_row_spans_are_q_k_and_v_of_the_ranks_heads(tiny_cfg):
    rank0 = Transformer(tiny_cfg, seed=0, group=LocalGroup(0, 2))
    k = tiny_cfg.qkv_dim
    assert row_spans(rank0.layers[0].attn.qkv) == [(0, k // 2), (k, k + k // 2), (2 * k, 2 * k + k // 2)]
    with faults.injected("qkv_sharded_as_one_block"):
        assert row_spans(Transformer(tiny_cfg, seed=0, group=LocalGroup(0, 2)).layers[0].attn.qkv) == [(0, 3 * k // 2)]



def test_tp_sizes_are_the_sizes_the_model_builds_at_grouped_query_included():
    from lessons_lib.core.config import ModelConfig
    from lessons_lib.tp.plan import tp_sizes
    cfg = ModelConfig(n_layers=1, d_model=96, n_heads=12, n_kv_heads=4, d_head=8, d_ffn=192, vocab_size=16,
                      max_position=8)
    built = []
    for p in range(1, cfg.n_heads + 1):
        try:
            Transformer(cfg, seed=0, group=LocalGroup(0, p))
        except ValueError:
            continue
        built.append(p)
    assert tp_sizes(cfg) == built
    assert 3 not in built and 6 not in built  # they divide the 12 heads but cannot split the 4 K/V heads


def test_heads_held_finds_the_k_and_v_heads_of_a_grouped_query_shard():
    from lessons_lib.core.config import ModelConfig
    from lessons_lib.tp.plan import heads_held
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ffn=64, vocab_size=16, max_position=8)
    weights = init_weights(cfg, seed=0)
    got = [heads_held(weights, Transformer(cfg, weights, group=LocalGroup(r, 2))) for r in range(2)]
    assert got == [{"Q": [0, 1], "K": [0], "V": [0]}, {"Q": [2, 3], "K": [1], "V": [1]}]
