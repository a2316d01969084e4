"""tp.threads.forward_in_threads: a whole forward on thread ranks that really add, and a fault it must show."""
import torch

from lessons_lib import faults
from lessons_lib.core.batch import pack
from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer, init_weights
from lessons_lib.measure.tolerance import max_abs_diff, tolerance
from lessons_lib.tp.threads import forward_in_threads

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_ffn=64, vocab_size=50, max_position=16)


def test_forward_in_threads_equals_tp1_and_shows_a_bias_added_on_every_rank():
    weights = init_weights(CFG, seed=1)
    batch = pack([torch.arange(n) * 3 % CFG.vocab_size for n in (5, 2)])
    ref, exact = Transformer(CFG, weights)(batch), Transformer(CFG, weights, dtype=torch.float64)(batch)
    bound = tolerance(ref, exact)
    for tp in (1, 2, 4):
        got = forward_in_threads(CFG, weights, batch, tp)
        assert got.shape == (7, CFG.d_model) and got.dtype == torch.float32
        assert max_abs_diff(got, exact) <= bound, tp
    assert forward_in_threads(CFG, weights, batch, 2, dtype=torch.float64).dtype == torch.float64
    with faults.injected("row_parallel_bias_on_every_rank"):  # the ranks really add: two biases in the sum
        assert max_abs_diff(forward_in_threads(CFG, weights, batch, 2), exact) > 100 * bound
