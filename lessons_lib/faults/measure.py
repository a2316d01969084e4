"""Faults of the measuring tools (``measure``): what the lessons run their experiments on and count with."""
from __future__ import annotations

from .registry import fault, swap_function

AREA = "measure"


@fault("random_qkv_rows_all_equal", "measure.profile.random_qkv draws one token's q, k and v and repeats it for every "
       "token (a broadcast where one draw per row was meant): an attention output cannot tell which rows it read", AREA)
def _random_qkv_rows_all_equal():
    from ..measure import profile
    real = profile.random_qkv

    def random_qkv(*args, **kwargs):
        drawn = real(*args, **kwargs)
        same = tuple(x[:1].expand_as(x).clone() if x.shape[0] else x for x in drawn[:3])
        return same + tuple(drawn[3:])
    return [swap_function(profile, "random_qkv", random_qkv)]


# ---- lesson 05's counts: the recorder, measure.flops, the machines ----------------------------------------------

@fault("matmul_flops_count_multiply_adds", "measure.recorder's Matmul.flops counts multiply-adds, batch·m·k·n, not "
       "2·batch·m·k·n FLOPs: every recorded FLOP count and FLOP/byte is halved", AREA)
def _matmul_flops_count_multiply_adds():
    from ..measure import recorder
    from .registry import swap_attr
    return [swap_attr(recorder.Matmul, "flops", property(lambda mm: mm.batch * mm.m * mm.k * mm.n))]


@fault("bmm_recorded_as_one_head", "measure.recorder reads a batched matmul (bmm: one per head) as one plain matmul: "
       "its batch of heads is dropped, so recorded attention FLOPs are one head's", AREA)
def _bmm_recorded_as_one_head():
    from ..measure import recorder
    real = recorder._matmul

    def _matmul(op):
        mm = real(op)
        return recorder.Matmul(mm.kind, 1, mm.m, mm.k, mm.n)
    return [swap_function(recorder, "_matmul", _matmul)]


@fault("linear_flops_per_token_one_layer", "measure.flops.linear_flops_per_token counts one layer, not all n_layers: "
       "forward_flops' linear part is one layer's while attention counts every layer", AREA)
def _linear_flops_per_token_one_layer():
    from ..measure import flops
    real = flops.linear_flops_per_token

    def linear_flops_per_token(cfg, n_kv_heads=None):
        return real(cfg, n_kv_heads) // cfg.n_layers
    return [swap_function(flops, "linear_flops_per_token", linear_flops_per_token)]


@fault("causal_cells_exclude_diagonal", "measure.flops.attention_cells counts a causal block's useful cells as "
       "L(L - 1) / 2, the diagonal (each token with itself) left out", AREA)
def _causal_cells_exclude_diagonal():
    from ..measure import flops
    real = flops.attention_cells

    def attention_cells(seq_lens, method, causal=False):
        cells = real(seq_lens, method, causal)
        if not causal:
            return cells
        diagonal = sum(seq_lens)
        computed = cells.computed - diagonal if method == "varlen" else cells.computed
        return flops.AttentionCells(computed, cells.useful - diagonal, computed - cells.useful + diagonal)
    return [swap_function(flops, "attention_cells", attention_cells)]


@fault("kv_cache_bytes_counts_k_only", "measure.flops.kv_cache_bytes counts the cached keys and forgets the values: "
       "half the bytes the KV cache holds", AREA)
def _kv_cache_bytes_counts_k_only():
    from ..measure import flops
    real = flops.kv_cache_bytes

    def kv_cache_bytes(cfg, seq_lens, n_kv_heads=None, bytes_per_element=2):
        return real(cfg, seq_lens, n_kv_heads, bytes_per_element) // 2
    return [swap_function(flops, "kv_cache_bytes", kv_cache_bytes)]


@fault("decode_kv_read_shared_by_batch", "measure.flops.decode_step_parts counts the KV cache read once per step, "
       "like a weight shared by the batch, not once per request: decode attention's bytes do not grow with R", AREA)
def _decode_kv_read_shared_by_batch():
    from ..measure import flops
    real = flops.decode_step_parts

    def decode_step_parts(cfg, requests, kv_len, machine, bytes_per_element=2):
        step = real(cfg, requests, kv_len, machine, bytes_per_element)
        att = step.attention
        return flops.DecodeStep(step.linear, machine.roofline_part(att.flops, att.bytes / requests))
    return [swap_function(flops, "decode_step_parts", decode_step_parts)]


@fault("h200_peak_with_sparsity", "measure.machines.H200 takes the datasheet's 2:4-sparsity peak, 1,979 TFLOP/s, "
       "for the dense bf16 one (989): its ridge doubles to 412 FLOP/byte", AREA)
def _h200_peak_with_sparsity():
    import dataclasses

    from ..measure import machines
    return [swap_function(machines, "H200", dataclasses.replace(machines.H200, peak_flops=1979e12))]


@fault("tolerance_without_eps", "measure.tolerance.tolerance forgets the eps factor: its bound is 2 |ref - ref64| + "
       "k · max |ref64|, not + k · eps · max |ref64|, so a row wrong by less than the values' size passes", AREA)
def _tolerance_without_eps():
    from ..measure import tolerance as rule
    real = rule.tolerance

    def tolerance(ref, ref64, dtype=None, k=rule.K_ULP):
        scale = max(1.0, ref64.detach().abs().max().item()) if ref64.numel() else 1.0
        return real(ref, ref64, dtype, k) + k * scale
    return [swap_function(rule, "tolerance", tolerance)]
