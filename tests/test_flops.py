"""flops.py against independent counts: brute-force masks, the score tensors the backends
really build, and torch.utils.flop_counter.FlopCounterMode (claims C8, C9, C10, C13, C14, C15)."""
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lessons_lib.core.attention import block_diag_mask, varlen_attention
from lessons_lib.core.batch import pack, pad, seq_lens_to_cu_seqlens
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.groups import LocalGroup
from lessons_lib.core.model import Transformer
from lessons_lib.measure.flops import (
    LINEAR_LAYERS,
    attention_cells,
    decode_attention_intensity,
    executed_tokens,
    forward_bytes,
    forward_flops,
    kv_cache_bytes,
    linear_flops_per_token,
    linear_intensity,
    linear_shapes,
    roofline_seconds,
)


def _brute_force(lens, causal):
    """(masked computed, useful, padded computed) counted from tensors, not formulas."""
    mask = block_diag_mask(seq_lens_to_cu_seqlens(lens), causal=causal)  # [T, T]
    _, pad_mask = pad([[0] * n for n in lens])                           # [R, Lmax]
    return mask.numel(), int(mask.sum()), pad_mask.shape[0] * pad_mask.shape[1] ** 2


def _softmax_cells(lens, backend, heads=1):
    """Score cells per head a backend really builds: the numel of its softmax inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), heads, 4, generator=g) for _ in range(3))
    seen = []
    real = torch.Tensor.softmax

    def spy(self, *a, **kw):
        seen.append(self.numel())
        return real(self, *a, **kw)

    torch.Tensor.softmax = spy
    try:
        varlen_attention(q, k, v, seq_lens_to_cu_seqlens(lens), causal=False, backend=backend)
    finally:
        torch.Tensor.softmax = real
    return sum(seen) // heads


def test_c8_masked_counts_a10_b30_computed_1600_useful_1000_wasted_600():
    cells = attention_cells([10, 30], "masked")
    computed, useful, _ = _brute_force([10, 30], causal=False)
    assert (computed, useful) == (1600, 1000)
    assert (cells.computed, cells.useful, cells.wasted) == (computed, useful, computed - useful) == (1600, 1000, 600)
    assert _softmax_cells([10, 30], "masked") == 1600
    causal = attention_cells([10, 30], "masked", causal=True)  # the lower triangles only: 55 + 465
    assert causal.useful == _brute_force([10, 30], causal=True)[1] == 520 and causal.computed == 1600


LENS_SETS = [[10, 30], [1], [1, 1, 1], [7, 3, 64, 1, 1, 20], [5] * 9, [100, 1]]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens", LENS_SETS, ids=str)
def test_attention_cells_match_brute_force_mask_counts(lens, causal):
    masked_computed, useful, padded_computed = _brute_force(lens, causal)
    for method, computed in (("masked", masked_computed), ("padded", padded_computed), ("varlen", useful)):
        cells = attention_cells(lens, method, causal=causal)
        assert (cells.computed, cells.useful, cells.wasted) == (computed, useful, computed - useful), method


@pytest.mark.parametrize("lens", LENS_SETS, ids=str)
def test_attention_cells_match_the_score_tensors_backends_build(lens):
    """Non-causal: what loop / masked / padded materialise is exactly what flops.py says they
    compute. (Causal: flops.py counts varlen as the triangles a real kernel like FlashAttention
    visits; our loop builds the full L_i x L_i squares and masks them, so causal is not compared here.)"""
    for backend, method in (("loop", "varlen"), ("masked", "masked"), ("padded", "padded")):
        assert _softmax_cells(lens, backend, heads=2) == attention_cells(lens, method).computed, backend


@pytest.mark.parametrize("r", [1, 2, 4, 8])
@pytest.mark.parametrize("length", [1, 4, 16])
def test_c9_masked_computes_rl_squared_needs_r_l_squared(r, length):
    cells = attention_cells([length] * r, "masked")
    computed, useful, _ = _brute_force([length] * r, causal=False)
    assert cells.computed == computed == (r * length) ** 2 and cells.useful == useful == r * length * length
    assert cells.wasted == r * (r - 1) * length * length  # waste/useful = R - 1: quadratic vs linear in R


def test_c10_varlen_computes_1000_with_no_waste():
    cells = attention_cells([10, 30], "varlen")
    assert (cells.computed, cells.useful, cells.wasted) == (1000, 1000, 0)
    assert _softmax_cells([10, 30], "loop") == 1000  # each request's own [L_i x L_i], nothing else


def test_c14_same_1000_tokens_1x1000_is_10x_the_attention_of_10x100():
    long, short = attention_cells([1000], "varlen"), attention_cells([100] * 10, "varlen")
    assert (long.computed, short.computed) == (10**6, 10**5)
    assert (_softmax_cells([1000], "loop"), _softmax_cells([100] * 10, "loop")) == (10**6, 10**5)
    cfg = ModelConfig()
    f_long, f_short = forward_flops(cfg, [1000]), forward_flops(cfg, [100] * 10)
    assert f_long.linear == f_short.linear  # same 1000 tokens through the same weights
    assert f_long.attention == 10 * f_short.attention
    # The bottleneck moves: attention overtakes the linear layers once a request's length L
    # satisfies n_layers * n_heads * 4 * d_head * L^2 > L * linear_flops_per_token.
    crossover = linear_flops_per_token(cfg) / (cfg.n_layers * cfg.n_heads * 4 * cfg.d_head)
    assert 1000 < crossover < 10_000
    assert forward_flops(cfg, [10_000]).dominant == "attention" and f_short.dominant == "linear"


def _counted(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op).removeprefix("aten."): n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("backend,method", [("loop", "varlen"), ("masked", "masked"), ("padded", "padded")])
def test_forward_flops_matches_flop_counter_mode(backend, method, tiny_cfg):
    """FlopCounterMode counts 2*m*k*n per matrix product (mm, addmm, bmm, ...) and nothing else:
    no softmax, LayerNorm, GeLU, residual adds or embedding lookups, the same convention as
    flops.py. Linear layers appear as addmm (with bias) / mm (row-parallel, bias added after
    the all-reduce); attention as bmm (Q K^T and P V). The SDPA backend's fused CPU kernel is not
    in FlopCounterMode's table, which is why the matmul backends are the ones counted."""
    lens = [10, 30, 7, 1]
    model = Transformer(tiny_cfg, seed=0)
    reqs = [[1] * n for n in lens]
    counts = _counted(lambda: model(pack(reqs), attn_backend=backend))
    # The flat forward runs its linear layers on the T flat rows whatever the attention backend
    # (even "padded" pads only inside attention); causal=False: these backends build whole squares.
    assert counts["addmm"] + counts["mm"] == forward_flops(tiny_cfg, lens, "varlen").linear
    assert counts["bmm"] == forward_flops(tiny_cfg, lens, method).attention
    assert set(counts) <= {"addmm", "mm", "bmm"}


def test_forward_flops_padded_forward_counts_pad_rows(tiny_cfg):
    lens = [10, 30, 7, 1]
    model = Transformer(tiny_cfg, seed=0)
    ids, mask = pad([[1] * n for n in lens])
    counts = _counted(lambda: model.forward_padded(ids, mask))
    want = forward_flops(tiny_cfg, lens, "padded")
    assert executed_tokens(lens, "padded") == ids.numel() == 4 * 30
    assert counts["addmm"] + counts["mm"] == want.linear and counts["bmm"] == want.attention
    useful = forward_flops(tiny_cfg, lens, "padded", useful_only=True)
    assert useful.linear == sum(lens) * linear_flops_per_token(tiny_cfg)
    assert useful.attention == tiny_cfg.n_layers * tiny_cfg.n_heads * 4 * tiny_cfg.d_head * sum(n * n for n in lens)


@pytest.mark.parametrize("tokens", [1, 10, 40, 1000, 100_000])
def test_c13_linear_intensity_is_flops_over_bytes_and_grows_with_tokens(tokens):
    d_in, d_out = 512, 2048
    x, w = torch.empty(tokens, d_in, device="meta"), torch.empty(d_out, d_in, device="meta")
    flops = _counted(lambda: F.linear(x, w))["mm"]
    bytes_moved = 4 * (w.numel() + x.numel() + tokens * d_out)  # read W once, read X, write Y (fp32)
    assert linear_intensity(tokens, d_in, d_out) == pytest.approx(flops / bytes_moved, rel=1e-12)
    if tokens > 1:
        assert linear_intensity(tokens, d_in, d_out) > linear_intensity(tokens // 10 or 1, d_in, d_out)
    assert linear_intensity(tokens, d_in, d_out) < 2 * d_in * d_out / (4 * (d_in + d_out))  # saturation


@pytest.mark.parametrize("kv_len", [16, 1024, 32_768])
def test_c15_decode_attention_intensity_is_about_1_flop_per_byte(kv_len):
    q, k = torch.empty(1, 64, device="meta"), torch.empty(kv_len, 64, device="meta")
    flops = _counted(lambda: q @ k.T)["mm"]
    bytes_moved = 2 * (k.numel() + q.numel() + kv_len)  # bf16: read K and q, write the scores
    got = decode_attention_intensity(kv_len, 64)
    assert got == pytest.approx(flops / bytes_moved, rel=1e-12)
    assert 0.7 < got < 1.0 and math.isclose(got, 1.0, rel_tol=0.3)


# --- grouped-query attention, bytes, the roofline ---------------------------------------------------------

def test_gqa_default_is_the_course_model_and_kv_heads_shrink_only_k_and_v():
    cfg = ModelConfig()
    assert linear_flops_per_token(cfg, n_kv_heads=8) == linear_flops_per_token(cfg) == 8 * 2 * 3_145_728
    assert linear_shapes(replace(cfg, n_kv_heads=2)) == ((512, 512 + 2 * 128), (512, 512), (512, 2048), (2048, 512))
    one, grouped = forward_flops(cfg, [100] * 10), forward_flops(cfg, [100] * 10, n_kv_heads=1)
    assert grouped.attention == one.attention                       # every query head keeps its own scores
    assert one.linear - grouped.linear == 8 * 1000 * 2 * 512 * 2 * (512 - 64)
    assert kv_cache_bytes(cfg, [10, 30]) == 8 * 40 * 2 * 512 * 2 and kv_cache_bytes(cfg, [10, 30], 2) == 8 * 40 * 2 * 128 * 2
    for bad, what in ((3, r"n_kv_heads=3 must divide n_heads=8 \(each K/V head serves a whole group"),
                      (0, "n_kv_heads must be a positive int, got 0"), (16, "n_kv_heads=16 must divide n_heads=8"),
                      (2.0, "n_kv_heads must be a positive int, got 2.0")):
        with pytest.raises(ValueError, match=what):
            forward_flops(cfg, [4], n_kv_heads=bad)


@pytest.mark.parametrize("n_kv_heads, tp", [(None, 1), (None, 2), (None, 4), (2, 2), (2, 4), (1, 4), (4, 2)])
def test_linear_shapes_are_one_ranks_weights_in_the_engine(n_kv_heads, tp):
    """Read off the engine's own shard (rank 0 of ``tp``, a stand-in group): ``[out, in]`` weights -> ``(in, out)``,
    K/V heads replicated when the ranks outnumber them."""
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=4, n_kv_heads=n_kv_heads, d_head=16, d_ffn=128, vocab_size=10,
                      max_position=8)
    block = Transformer(cfg, seed=0, group=LocalGroup(0, tp)).layers[0]
    layers = (block.attn.qkv, block.attn.out_proj, block.mlp.fc_up, block.mlp.fc_down)
    assert linear_shapes(cfg, tp) == tuple(tuple(layer.weight.shape[::-1]) for layer in layers)
    assert len(LINEAR_LAYERS) == len(layers)


@pytest.mark.parametrize("tp, match", [(3, "tp_size=3 must divide n_heads=8 and d_ffn=2048"), (0, "tp_size must be a positive int"),
                                       (16, "tp_size=16 must divide n_heads=8")])
def test_linear_shapes_refuse_a_tp_size_that_does_not_split_the_model(tp, match):
    with pytest.raises(ValueError, match=match):
        linear_shapes(ModelConfig(), tp)


def test_forward_bytes_counts_weights_once_and_rows_per_token():
    cfg = ModelConfig()
    b1, b2 = forward_bytes(cfg, [1]), forward_bytes(cfg, [600, 400])
    assert b1.linear == 8 * 2 * (3_145_728 + 8192) and b1.attention == 8 * 2 * 4 * 512
    assert b2.linear - b1.linear == 8 * 2 * 999 * 8192               # the weights do not come back
    assert forward_bytes(cfg, [1000], bytes_per_element=4).total == 2 * forward_bytes(cfg, [1000]).total
    assert forward_bytes(cfg, [1000], n_kv_heads=4).attention == 8 * 2 * 1000 * (2 * 512 + 2 * 256)
    with pytest.raises(ValueError, match="bytes_per_element"):
        forward_bytes(cfg, [4], bytes_per_element=3)


def test_c13_roofline_time_is_the_longer_of_arithmetic_and_memory():
    assert roofline_seconds(100, 10, peak_flops=10, bytes_per_s=10) == 10       # compute: 100 / 10
    assert roofline_seconds(100, 500, peak_flops=10, bytes_per_s=10) == 50      # memory: 500 / 10
    f, b = forward_flops(ModelConfig(), [100] * 10, causal=True), forward_bytes(ModelConfig(), [100] * 10)
    h200 = (989e12, 4.8e12)
    assert f.linear / b.linear > h200[0] / h200[1] > f.attention / b.attention  # C13's 10 x 100 on an H200
    with pytest.raises(ValueError, match="> 0"):
        roofline_seconds(1, 1, 0, 1)
