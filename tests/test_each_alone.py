"""measure.tolerance.each_alone: every request alone, its float64 twin and the tolerance rule's bound."""
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.measure.tolerance import each_alone, float64_twin, tolerance

CFG = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_head=16, d_ffn=64, vocab_size=64, max_position=64)


def test_each_request_alone_with_its_float64_run_and_bound():
    model = Transformer(CFG, seed=0)
    requests = [torch.arange(5), torch.arange(9) % 7]
    runs = each_alone(model, requests)
    twin = float64_twin(model)
    assert len(runs) == 2
    for req, (out, out64, bound) in zip(requests, runs):
        alone, alone64 = model.forward_each([req])[0], twin.forward_each([req])[0]
        assert out.dtype == torch.float32 and out64.dtype == torch.float64 and out.shape == (len(req), CFG.d_model)
        assert torch.equal(out, alone) and torch.equal(out64, alone64)
        assert bound == tolerance(alone, alone64, torch.float32) and bound > 0
