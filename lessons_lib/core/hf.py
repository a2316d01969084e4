"""Bridge to Hugging Face ``transformers``' GPT-2 (no downloads: random-init configs).

HF GPT-2 stores its projections as ``Conv1D`` with ``weight: [in, out]``; ours is PyTorch's
``[out, in]``, so every projection is transposed on the way in. The fused ``c_attn`` is
``[Q | K | V]`` along the output, heads contiguous inside each, the same order as our
``attn.qkv``. HF's varlen argument is called ``cu_seq_lens_q``; ours ``cu_seqlens``.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .model import Transformer

Tensor = torch.Tensor


def hf_config(cfg: ModelConfig):
    """The ``GPT2Config`` with our sizes (``n_inner`` = d_ffn, ``gelu_new`` = tanh GeLU)."""
    from transformers import GPT2Config

    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError(f"GPT-2 needs n_heads*d_head == d_model, got {cfg.n_heads}*{cfg.d_head} != {cfg.d_model}")
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_position, n_embd=cfg.d_model,
                      n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ffn, activation_function="gelu_new",
                      layer_norm_epsilon=cfg.layer_norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1)  # GPT-2: 50256


def make_hf_gpt2(cfg: ModelConfig, attn_implementation: str = "sdpa", seed: int = 0):
    """A random-init ``GPT2Model`` in eval mode (the constructor rejects attn_implementation;
    ``_from_config`` takes it)."""
    from transformers import GPT2Model

    torch.manual_seed(seed)
    model = GPT2Model._from_config(hf_config(cfg), attn_implementation=attn_implementation, dtype=cfg.dtype)
    return model.eval()


def full_weights_from_hf(state_dict: dict[str, Tensor], n_layers: int | None = None) -> dict[str, Tensor]:
    """HF GPT-2 state dict (``GPT2Model`` or ``GPT2LMHeadModel``) → our full weights dict."""
    sd = {k.removeprefix("transformer."): v for k, v in state_dict.items()}
    if "wte.weight" not in sd:
        raise ValueError("not a GPT-2 state dict: no 'wte.weight' (or 'transformer.wte.weight') key")
    if n_layers is None:
        n_layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
    parts = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_attn.weight", "attn.c_attn.bias",
             "attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
             "mlp.c_proj.bias")
    missing = [k for k in ["wpe.weight", "ln_f.weight", "ln_f.bias"] if k not in sd] + [
        f"h.{i}.{p}" for i in range(n_layers) for p in parts if f"h.{i}.{p}" not in sd]
    if missing:
        raise ValueError(f"GPT-2 state dict for n_layers={n_layers} is missing {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")
    w = {"wte": sd["wte.weight"], "wpe": sd["wpe.weight"], "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"]}
    for i in range(n_layers):
        h, p = f"h.{i}.", f"layers.{i}."
        w |= {p + "ln_1.weight": sd[h + "ln_1.weight"], p + "ln_1.bias": sd[h + "ln_1.bias"],
              p + "ln_2.weight": sd[h + "ln_2.weight"], p + "ln_2.bias": sd[h + "ln_2.bias"],
              p + "attn.qkv.weight": sd[h + "attn.c_attn.weight"].T, p + "attn.qkv.bias": sd[h + "attn.c_attn.bias"],
              p + "attn.out_proj.weight": sd[h + "attn.c_proj.weight"].T,
              p + "attn.out_proj.bias": sd[h + "attn.c_proj.bias"],
              p + "mlp.fc_up.weight": sd[h + "mlp.c_fc.weight"].T, p + "mlp.fc_up.bias": sd[h + "mlp.c_fc.bias"],
              p + "mlp.fc_down.weight": sd[h + "mlp.c_proj.weight"].T, p + "mlp.fc_down.bias": sd[h + "mlp.c_proj.bias"]}
    return {k: v.detach().contiguous() for k, v in w.items()}


def config_from_hf(hf_cfg, tp_size: int = 1, dtype: torch.dtype = torch.float32) -> ModelConfig:
    if hf_cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"our blocks use tanh GeLU; the HF config has activation_function="
                         f"{hf_cfg.activation_function!r}")
    d, h = hf_cfg.n_embd, hf_cfg.n_head
    return ModelConfig(n_layers=hf_cfg.n_layer, d_model=d, n_heads=h, d_head=d // h,
                       d_ffn=hf_cfg.n_inner or 4 * d, vocab_size=hf_cfg.vocab_size, max_position=hf_cfg.n_positions,
                       tp_size=tp_size, dtype=dtype, layer_norm_eps=hf_cfg.layer_norm_epsilon)


def from_hf_gpt2(hf_model_or_state_dict, cfg: ModelConfig | None = None, **model_kw) -> Transformer:
    """Our ``Transformer`` with the weights of a HF ``GPT2Model`` / ``GPT2LMHeadModel`` (or its state dict).

    ``cfg`` defaults to the HF model's own config; pass it when giving a bare state dict.
    """
    obj = hf_model_or_state_dict
    if isinstance(obj, dict):
        if cfg is None:
            raise ValueError("from_hf_gpt2(state_dict) needs cfg=ModelConfig(...) (a state dict carries no config)")
        sd = obj
    else:
        if not hasattr(obj, "state_dict") or not hasattr(obj, "config"):
            raise ValueError(f"from_hf_gpt2 takes a HF GPT2Model / GPT2LMHeadModel or a state dict, "
                             f"got {type(obj).__name__}")
        sd = obj.state_dict()
        if cfg is None:
            cfg = config_from_hf(obj.config, dtype=next(obj.parameters()).dtype)
    return Transformer(cfg, full_weights_from_hf(sd, cfg.n_layers), **model_kw)
