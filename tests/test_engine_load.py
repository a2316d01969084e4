"""Load: 10,000 long-tailed requests through the engine in one run — nothing lost, nothing mixed,
bit-identical run to run, peak memory bounded by the batch budget.

Config: 2 layers, d_model 64, 4 heads of 16, FFN 256, vocab 1000, max_position 1024 (fp32, TP=1,
varlen/SDPA). Lengths: lognormal, median 16, sigma 1, clipped to [1, 1024] (about 260,000 tokens).
Budget: max_num_batched_tokens 4096, max_num_seqs 256.
"""
import hashlib
import random

import pytest
import torch

from lessons_lib.core.config import ModelConfig
from lessons_lib.core.model import Transformer
from lessons_lib.measure.bench import measure_peak_rss
from lessons_lib.measure.tolerance import assert_close
from lessons_lib.serve.engine import Engine
from lessons_lib.serve.workloads import long_tail_lengths, make_requests

CFG = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_ffn=256, vocab_size=1000, max_position=1024)
N, BUDGET, MAX_SEQS, SEED = 10_000, 4096, 256, 0
LENGTHS = long_tail_lengths(N, median=16, sigma=1.0, max_len=1024, seed=3)
REQUESTS = make_requests(LENGTHS, CFG.vocab_size, seed=4)


def _engine():
    return Engine(CFG, seed=SEED, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, progress=False)


def _digest(outs) -> str:
    h = hashlib.sha256()
    for o in outs:
        h.update(str(o.request_id).encode())
        h.update(o.last_hidden.numpy().tobytes())
        h.update(o.logits.numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Correctness and memory are under test here, not speed. Tiny requests make ~20,000 tiny ops;
    # with 2 OpenMP threads on a busy 2-core runner each op can wait milliseconds at a barrier
    # (measured: 1 s with 1 thread vs 17-34 s with 2 for 3,000 requests while other jobs ran).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def served():
    eng = _engine()
    eng.prefill(REQUESTS[:8])  # warm-up: first touch of the weights
    outs, peak = measure_peak_rss(lambda: eng.prefill(REQUESTS))
    return eng, outs, peak


def test_every_request_exactly_one_output_in_order(served):
    eng, outs, _ = served
    assert len(outs) == N
    assert [o.request_id for o in outs] == list(range(8, 8 + N)), "ids continue after the warm-up, in order"
    assert [o.num_tokens for o in outs] == LENGTHS
    assert all(o.last_hidden.shape == (CFG.d_model,) and o.logits.shape == (CFG.vocab_size,) for o in outs)
    assert sum(s.num_tokens for s in eng.stats) == sum(LENGTHS)
    assert sum(s.num_seqs for s in eng.stats) == N
    assert all(s.num_tokens <= BUDGET and s.num_seqs <= MAX_SEQS for s in eng.stats)
    served_ids = [i for s in eng.stats for i in s.request_ids]
    assert served_ids == [o.request_id for o in outs], "each id in exactly one batch, FCFS"
    assert all(torch.isfinite(o.logits).all() for o in outs[::97])


def test_sample_equals_per_request_reference(served):
    eng, outs, _ = served
    sample = sorted(random.Random(0).sample(range(N), 300)) + [max(range(N), key=LENGTHS.__getitem__)]
    refs = eng.model.forward_each([REQUESTS[i] for i in sample], attn_backend="loop")
    model64 = Transformer(CFG, eng.weights, dtype=torch.float64)
    refs64 = model64.forward_each([REQUESTS[i] for i in sample], attn_backend="loop")
    for i, ref, ref64 in zip(sample, refs, refs64):
        assert_close(outs[i].last_hidden, ref[-1], ref64[-1], f"request {i}")
        assert_close(outs[i].logits, eng.model.compute_logits(ref[-1:])[0], model64.compute_logits(ref64[-1:])[0],
                     f"logits of request {i}")


def test_same_seed_bit_identical_run_to_run(served):
    _, outs, _ = served
    again = _engine()  # fresh engine: weights rebuilt from the same seed
    again.prefill(REQUESTS[:8])
    assert _digest(again.prefill(REQUESTS)) == _digest(outs), "same seed, same backend: bit-identical"


def test_peak_memory_bounded_by_batch_budget(served):
    eng, outs, peak = served
    d, f, h = CFG.d_model, CFG.d_ffn, CFG.n_heads
    # What must stay: every request's last hidden row and logits.
    kept = N * (d + CFG.vocab_size) * 4
    # One batch in flight: <= BUDGET rows of at most max(6d, 2d + 2f) fp32 live activations
    # (attention: x, LN, QKV [3d], output; FFN: x, up and GeLU [f each], down), plus one
    # request's [H, L, L] scores (<= max_position), plus the batch's [R, vocab] logits.
    lmax = max(LENGTHS)
    batch = BUDGET * max(6 * d, 2 * d + 2 * f) * 4 + h * lmax * lmax * 4 + MAX_SEQS * CFG.vocab_size * 4
    bound = kept + 2 * batch + (64 << 20)  # x2: old and new tensors overlap; 64 MiB: allocator, threads
    masked_one_batch = h * BUDGET * BUDGET * 4  # what ONE [T x T] score tensor of one batch would take
    print(f"\npeak RSS above start: {peak / 2**20:.1f} MiB; bound {bound / 2**20:.1f} MiB "
          f"(outputs {kept / 2**20:.1f}, one batch {batch / 2**20:.1f}); "
          f"a single masked [H, T, T] score tensor at T={BUDGET}: {masked_one_batch / 2**20:.0f} MiB; "
          f"the whole stream as one [T, T]: {h * sum(LENGTHS) ** 2 * 4 / 2**40:.0f} TiB")
    assert masked_one_batch > bound, "the bound must be tight enough to catch [T x T] scores"
    assert peak <= bound, f"peak RSS {peak / 2**20:.1f} MiB exceeds the budget-derived bound {bound / 2**20:.1f} MiB"
