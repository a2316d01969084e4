"""ModelConfig is frozen and hashable: caches key on the config itself, variants come from dataclasses.replace."""
import dataclasses
import functools
import pickle

import pytest

from lessons_lib.core.config import ModelConfig


def test_config_cannot_be_changed_in_place():
    cfg = ModelConfig(n_layers=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3
    assert cfg.n_layers == 2


def test_equal_configs_share_one_cache_entry():
    calls = []

    @functools.cache
    def built(cfg):
        calls.append(cfg)
        return len(calls)

    assert built(ModelConfig(n_layers=2, n_kv_heads=4)) == built(ModelConfig(n_layers=2, n_kv_heads=4)) == 1
    assert built(ModelConfig(n_layers=3, n_kv_heads=4)) == 2
    assert len({ModelConfig(), ModelConfig(n_kv_heads=8), ModelConfig(n_kv_heads=2)}) == 2


def test_replace_keeps_the_resolved_kv_heads():
    cfg = ModelConfig()                                    # n_kv_heads None -> resolved to n_heads = 8
    wider = dataclasses.replace(cfg, n_heads=16)
    assert (wider.n_heads, wider.n_kv_heads) == (16, 8)   # GQA with 2 query heads per K/V head, as documented
    assert dataclasses.replace(cfg, n_heads=16, n_kv_heads=None).n_kv_heads == 16
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(cfg, n_heads=4)                # 8 K/V heads cannot serve 4 query heads


def test_config_survives_pickling_for_the_tp_workers():
    cfg = ModelConfig(n_layers=2, n_kv_heads=2)
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and hash(back) == hash(cfg) and back.n_kv_heads == 2
