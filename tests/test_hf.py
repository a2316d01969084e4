"""hf.py against Hugging Face transformers itself: random-init GPT-2 (no downloads) run per
request, our model run on the flat varlen batch."""
import copy

import pytest
import torch

from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.measure.hf import config_from_hf, from_hf_gpt2, full_weights_from_hf, hf_config, make_hf_gpt2
from lessons_lib.measure.tolerance import assert_close, tolerance

transformers = pytest.importorskip("transformers")  # a requirements.txt dependency: present in CI


@torch.no_grad()
def test_s1_hf_gpt2_per_request_matches_our_flat_varlen_forward(make_requests):
    """GPT2Config(n_embd=512, n_head=8, n_layer=8, n_inner=2048), random init; max_position 1024
    and vocab 8192 (not 50257) to save memory and init time: embedding rows are only looked up.
    HF runs each request alone (use_cache=False); we run all of them as one flat batch.
    Bound, FlashAttention's method applied to the whole model: our fp32 output may be at most
    twice as far from HF-in-float64 as HF-in-fp32 is (+2 ulp). Both are fp32 forwards of the
    same math, different only in summation order, so a wrong weight layout (a missing transpose,
    Q/K/V in the wrong order, a bias added twice) is off by O(0.1..1), far outside."""
    cfg = ModelConfig(max_position=1024, vocab_size=8192)
    hf = make_hf_gpt2(cfg)  # sdpa attention
    hf64 = copy.deepcopy(hf).double()
    ours = from_hf_gpt2(hf)
    assert (ours.cfg.n_layers, ours.cfg.d_model, ours.cfg.n_heads, ours.cfg.d_ffn) == (8, 512, 8, 2048)
    reqs = make_requests([1, 10, 30, 7, 65, 3], cfg.vocab_size)
    flat = ours(pack(reqs))
    hf32 = torch.cat([hf(input_ids=r[None], use_cache=False).last_hidden_state[0] for r in reqs])
    ref64 = torch.cat([hf64(input_ids=r[None], use_cache=False).last_hidden_state[0] for r in reqs])
    diff, tol = (flat - hf32).abs().max().item(), tolerance(hf32, ref64)
    print(f"HF GPT-2 per request vs our flat varlen: max abs diff {diff:.2e}; ours vs HF fp64 "
          f"{(flat.double() - ref64).abs().max().item():.2e}; bound {tol:.2e}")
    assert flat.shape == hf32.shape == (116, 512)
    assert_close(flat, hf32, ref64, "our flat varlen forward vs HF per request")
    assert diff <= 2 * tol  # both within tol of the fp64 truth


@torch.no_grad()
def test_hf_lm_head_state_dict_prefix_and_tied_logits(make_requests):
    """GPT2LMHeadModel keys carry a 'transformer.' prefix and its head is tied to wte: loading the
    model or its bare state dict gives the same weights, and compute_logits matches HF's logits."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=300, max_position=64)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel._from_config(hf_config(cfg), attn_implementation="eager").eval()
    ours = from_hf_gpt2(lm)
    from_sd = from_hf_gpt2(lm.state_dict(), cfg=cfg)
    for a, b in zip(ours.state_dict().values(), from_sd.state_dict().values()):
        assert torch.equal(a, b)
    reqs = make_requests([5, 1, 12], cfg.vocab_size)
    hidden = ours(pack(reqs))
    logits = ours.compute_logits(hidden)
    lm64 = copy.deepcopy(lm).double()
    hf_logits = torch.cat([lm(input_ids=r[None], use_cache=False).logits[0] for r in reqs])
    ref64 = torch.cat([lm64(input_ids=r[None], use_cache=False).logits[0] for r in reqs])
    assert_close(logits, hf_logits, ref64, "compute_logits vs HF's tied logits")


def test_hf_config_round_trip_and_weight_layout(tiny_cfg):
    hf_cfg = hf_config(tiny_cfg)
    assert (hf_cfg.n_embd, hf_cfg.n_head, hf_cfg.n_layer, hf_cfg.n_inner, hf_cfg.activation_function) == \
        (64, 4, 2, 256, "gelu_new")
    back = config_from_hf(hf_cfg)
    assert back == tiny_cfg
    hf = make_hf_gpt2(tiny_cfg)
    w = full_weights_from_hf(hf.state_dict())
    # Conv1D stores [in, out]; ours is PyTorch's [out, in].
    assert torch.equal(w["layers.0.attn.qkv.weight"], hf.h[0].attn.c_attn.weight.T)
    assert w["layers.1.mlp.fc_down.weight"].shape == (64, 256)
