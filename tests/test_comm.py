"""measure.comm: the ring all-reduce's traffic against a simulated ring, its times against the ring written out,
the crossover against the two terms, and the alpha-beta fit on synthetic links."""
import pytest
import torch

from lessons_lib.measure.comm import (
    NVLINK,
    AlphaBeta,
    all_reduce_seconds,
    crossover_tokens,
    fit_alpha_beta,
    ring_bytes_sent,
    ring_time_terms,
)
from lessons_lib.measure.machines import H200


def _ring(alpha, beta, payload, p):
    """The ring model written out on its own: 2(p-1) steps, each alpha + (S/p)/beta."""
    return 2 * (p - 1) * (alpha + payload / p / beta)


def _simulated_ring(buffers):
    """A ring all-reduce run step by step on p lists of p chunks: (every rank's result, numbers rank 0 sent)."""
    p = len(buffers)
    chunks = [list(b) for b in buffers]
    sent = 0
    for step in range(p - 1):  # reduce-scatter: rank r sends chunk (r - step) to r + 1, which adds it
        outgoing = [(r, (r - step) % p, chunks[r][(r - step) % p]) for r in range(p)]
        for r, c, value in outgoing:
            chunks[(r + 1) % p][c] = chunks[(r + 1) % p][c] + value
        sent += 1
    for step in range(p - 1):  # all-gather: rank r sends its finished chunk (r + 1 - step) to r + 1
        outgoing = [(r, (r + 1 - step) % p, chunks[r][(r + 1 - step) % p]) for r in range(p)]
        for r, c, value in outgoing:
            chunks[(r + 1) % p][c] = value
        sent += 1
    return chunks, sent


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_ring_bytes_sent_is_what_a_simulated_ring_sends(p):
    g = torch.Generator().manual_seed(p)
    buffers = [torch.randint(0, 100, (p,), generator=g).tolist() for _ in range(p)]
    result, chunks_sent = _simulated_ring(buffers)
    assert all(r == [sum(col) for col in zip(*buffers)] for r in result)  # the ring really all-reduces
    chunk_bytes = 1024
    assert ring_bytes_sent(p * chunk_bytes, p) == chunks_sent * chunk_bytes


def test_ring_time_terms_are_the_ring_written_out():
    fit = AlphaBeta(20e-6, 4e9)
    for p in (2, 4, 8):
        for payload in (0, 1, 4096, 3 << 20):
            latency, bandwidth = ring_time_terms(fit, payload, p)
            assert latency + bandwidth == pytest.approx(_ring(20e-6, 4e9, payload, p), rel=1e-12)
            assert latency == pytest.approx(_ring(20e-6, 4e9, 0, p)) and all_reduce_seconds(fit, payload, p) == latency + bandwidth


@pytest.mark.parametrize("fit", [NVLINK, AlphaBeta(40e-6, 1.3e9)], ids=["nvlink", "slow"])
@pytest.mark.parametrize("p, itemsize", [(2, 4), (2, 2), (4, 2)])
def test_at_the_crossover_the_two_terms_are_equal(fit, p, itemsize):
    n = crossover_tokens(fit, 512, itemsize, p)
    latency, bandwidth = ring_time_terms(fit, n * 512 * itemsize, p)
    assert bandwidth == pytest.approx(latency, rel=1e-12)
    below, above = (ring_time_terms(fit, m * 512 * itemsize, p) for m in (n / 2, 2 * n))
    assert below[1] < below[0] and above[1] > above[0]


def test_nvlink_is_the_h200s_link_one_way():
    assert NVLINK.beta == H200.link_bytes_per_s and NVLINK.source


def test_fit_alpha_beta_recovers_a_synthetic_link():
    sizes = [2 ** k for k in range(10, 24)]
    for p in (2, 4):
        exact = [_ring(30e-6, 3e9, s, p) for s in sizes]
        fit = fit_alpha_beta(sizes, exact, world_size=p)
        assert (fit.alpha_s, fit.beta) == (30e-6, 3e9)  # exact data, 3 significant digits
    rng = torch.Generator().manual_seed(0)
    noisy = [_ring(30e-6, 3e9, s, 2) * (1 + 0.05 * (torch.rand((), generator=rng).item() - 0.5)) for s in sizes]
    fit = fit_alpha_beta(sizes, noisy)
    assert abs(fit.alpha_s / 30e-6 - 1) < 0.05 and abs(fit.beta / 3e9 - 1) < 0.05
    # A line with a (noise-made) negative intercept: refitted through 0, alpha = 0, the bandwidth still found.
    zero = fit_alpha_beta(sizes, [s / 1e9 - 2e-7 for s in sizes])
    assert zero.alpha_s == 0 and abs(zero.beta / 1e9 - 1) < 0.1


@pytest.mark.parametrize("sizes, times, match", [([1, 2], [1e-3], "same length"), ([5, 5], [1e-3, 2e-3], "two distinct"),
                                                 ([1, 2], [0, 1e-3], "positive"), ([1, 10, 100], [3e-3, 2e-3, 1e-3], "grow"),
                                                 ([1, 2], [float("nan"), 1e-3], "positive")])
def test_fit_alpha_beta_refuses_what_it_cannot_fit(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(sizes, times)


def test_the_model_refuses_bad_values():
    for bad in ({"alpha_s": -1e-6, "beta": 1e9}, {"alpha_s": 1e-6, "beta": 0}, {"alpha_s": float("inf"), "beta": 1e9},
                {"alpha_s": 1e-6, "beta": True}):
        with pytest.raises(ValueError, match="AlphaBeta"):
            AlphaBeta(**bad)
    with pytest.raises(ValueError, match="world_size"):
        ring_time_terms(AlphaBeta(1e-6, 1e9), 100, world_size=1)
    with pytest.raises(ValueError, match="payload_bytes must be a non-negative number"):
        ring_time_terms(NVLINK, -1)
    with pytest.raises(ValueError, match="itemsize"):
        crossover_tokens(NVLINK, 512, 0)
    with pytest.raises(ValueError, match="payload must be an int >= 0"):
        ring_bytes_sent(-4, 2)
