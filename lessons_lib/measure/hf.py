"""Bridge to Hugging Face ``transformers``' GPT-2 (no downloads: random-init configs).

HF GPT-2 stores its projections as ``Conv1D`` with ``weight: [in, out]``; ours is PyTorch's
``[out, in]``, so those are transposed on the way in. The fused ``c_attn`` is ``[Q | K | V]``
along the output, heads contiguous inside each: the order of our ``attn.qkv``. HF calls the
varlen boundaries ``cu_seq_lens_q``; we call them ``cu_seqlens``.
"""
from __future__ import annotations

import torch

from ..core.config import _BLOCK, ModelConfig
from ..core.model import Transformer

Tensor = torch.Tensor

# HF's names of our four block linears; a linear's weight is stored transposed (Conv1D [in, out]).
_HF_MODULES = {"attn.qkv": "attn.c_attn", "attn.out_proj": "attn.c_proj", "mlp.fc_up": "mlp.c_fc",
               "mlp.fc_down": "mlp.c_proj"}
# our name (inside a block, from the one weight table) → (HF name inside ``h.<i>.``, stored transposed?)
_BLOCK_NAMES = {ours: (f"{_HF_MODULES.get(module, module)}.{param}", module in _HF_MODULES and param == "weight")
                for ours in _BLOCK for module, param in [ours.rsplit(".", 1)]}
_TOP_NAMES = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f.weight": "ln_f.weight", "ln_f.bias": "ln_f.bias"}


def hf_config(cfg: ModelConfig):
    """The ``GPT2Config`` with our sizes (``n_inner`` = d_ffn, ``gelu_new`` = tanh GeLU, no dropout)."""
    if cfg.n_heads * cfg.d_head != cfg.d_model:
        raise ValueError(f"GPT-2 needs n_heads*d_head == d_model, got {cfg.n_heads}*{cfg.d_head} != {cfg.d_model}")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"GPT-2 has no grouped-query attention: it needs n_kv_heads == n_heads, got "
                         f"n_kv_heads={cfg.n_kv_heads}, n_heads={cfg.n_heads}")
    from transformers import GPT2Config  # after the checks: a refusal needs no transformers import
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_position, n_embd=cfg.d_model,
                      n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ffn, activation_function="gelu_new",
                      layer_norm_epsilon=cfg.layer_norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1)


def make_hf_gpt2(cfg: ModelConfig, attn_implementation: str = "sdpa", seed: int = 0):
    """A random-init ``GPT2Model`` in eval mode (``_from_config`` takes ``attn_implementation``;
    the constructor does not)."""
    from transformers import GPT2Model

    torch.manual_seed(seed)
    model = GPT2Model._from_config(hf_config(cfg), attn_implementation=attn_implementation, dtype=cfg.dtype)
    return model.eval()


def full_weights_from_hf(state_dict: dict[str, Tensor], n_layers: int | None = None) -> dict[str, Tensor]:
    """HF GPT-2 state dict (``GPT2Model`` or ``GPT2LMHeadModel``) → our full weights (``ModelConfig.weight_shapes``)."""
    sd = {k.removeprefix("transformer."): v for k, v in state_dict.items()}
    if "wte.weight" not in sd:
        raise ValueError("not a GPT-2 state dict: no 'wte.weight' (or 'transformer.wte.weight') key")
    if n_layers is None:
        n_layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
    names = {ours: (hf, False) for ours, hf in _TOP_NAMES.items()} | {
        f"layers.{i}.{ours}": (f"h.{i}.{hf}", t) for i in range(n_layers) for ours, (hf, t) in _BLOCK_NAMES.items()}
    missing = [hf for hf, _ in names.values() if hf not in sd]
    if missing:
        raise ValueError(f"GPT-2 state dict for n_layers={n_layers} is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return {ours: (sd[hf].T if t else sd[hf]).detach().contiguous() for ours, (hf, t) in names.items()}


def config_from_hf(hf_cfg, dtype: torch.dtype = torch.float32) -> ModelConfig:
    """A HF ``GPT2Config`` → our ``ModelConfig`` (GPT-2 is multi-head: ``n_kv_heads = n_heads``)."""
    if hf_cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"our blocks use tanh GeLU; the HF config has activation_function={hf_cfg.activation_function!r}")
    d, h = hf_cfg.n_embd, hf_cfg.n_head
    return ModelConfig(n_layers=hf_cfg.n_layer, d_model=d, n_heads=h, d_head=d // h, d_ffn=hf_cfg.n_inner or 4 * d,
                       vocab_size=hf_cfg.vocab_size, max_position=hf_cfg.n_positions, dtype=dtype,
                       layer_norm_eps=hf_cfg.layer_norm_epsilon)


def from_hf_gpt2(hf_model_or_state_dict, cfg: ModelConfig | None = None, **model_kw) -> Transformer:
    """Our ``Transformer`` with the weights of a HF ``GPT2Model`` / ``GPT2LMHeadModel`` (or its state dict).

    ``cfg`` defaults to the HF model's own config; give it with a bare state dict.
    """
    obj = hf_model_or_state_dict
    if isinstance(obj, dict):
        if cfg is None:
            raise ValueError("from_hf_gpt2(state_dict) needs cfg=ModelConfig(...) (a state dict carries no config)")
        sd = obj
    elif hasattr(obj, "state_dict") and hasattr(obj, "config"):
        sd = obj.state_dict()
        cfg = cfg or config_from_hf(obj.config, dtype=next(obj.parameters()).dtype)
    else:
        raise ValueError(f"from_hf_gpt2 takes a HF GPT2Model / GPT2LMHeadModel or a state dict, got {type(obj).__name__}")
    return Transformer(cfg, full_weights_from_hf(sd, cfg.n_layers), **model_kw)
