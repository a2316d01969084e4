"""measure.machines: the Machine's checks, its ridge and roofline, the published constants' dtypes, this_cpu's measurement."""
import dataclasses

import pytest
import torch

from lessons_lib.measure import machines
from lessons_lib.measure.machines import A100, H200, REFERENCE_CPU, Machine, this_cpu


@pytest.mark.parametrize("machine", [H200, A100, REFERENCE_CPU], ids=lambda m: m.name)
def test_a_kernel_at_the_ridge_waits_as_long_for_memory_as_for_arithmetic(machine):
    nbytes = 3e9
    at_ridge = machine.roofline_seconds(machine.ridge * nbytes, nbytes)
    assert at_ridge == pytest.approx(nbytes / machine.bytes_per_s) == pytest.approx(machine.ridge * nbytes / machine.peak_flops)
    below, above = machine.roofline_seconds(nbytes, nbytes), machine.roofline_seconds(1e4 * machine.ridge * nbytes, nbytes)
    assert below == nbytes / machine.bytes_per_s                       # 1 FLOP/byte: memory-bound
    assert above == 1e4 * machine.ridge * nbytes / machine.peak_flops   # far above the ridge: compute-bound


def test_the_peaks_dtype_sets_the_bytes_of_a_number():
    assert [m.itemsize for m in (H200, A100, REFERENCE_CPU)] == [torch.empty((), dtype=d).element_size()
                                                                 for d in (torch.bfloat16, torch.bfloat16, torch.float32)]


def test_a_machine_is_frozen_and_hashable():
    again = Machine(**{f.name: getattr(H200, f.name) for f in dataclasses.fields(H200)})
    assert again is not H200 and {H200: "gpu"}[again] == "gpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        H200.peak_flops = 1.0


@pytest.mark.parametrize("changes, match", [
    ({"peak_flops": 0}, "Machine.peak_flops must be a positive finite number, got 0"),
    ({"bytes_per_s": float("inf")}, "Machine.bytes_per_s must be a positive finite number"),
    ({"bytes_per_s": None}, "Machine.bytes_per_s must be a positive finite number, got None"),
    ({"launch_s": -1e-6}, "Machine.launch_s must be a positive finite number or None"),
    ({"link_bytes_per_s": True}, "Machine.link_bytes_per_s"),
    ({"n_sms": 0}, "Machine.n_sms must be a positive int"),
    ({"dtype": torch.int8}, "Machine.dtype must be a floating torch.dtype"),
    ({"name": ""}, "Machine.name must be a non-empty string")])
def test_a_machine_refuses_numbers_it_cannot_price_with(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(H200, **changes)


def test_this_cpu_is_measured_once_and_reads_the_measurement(monkeypatch):
    """The peak is the GEMM measurement's (a stand-in of 2 GFLOP/s shows through); a second call is the cached Machine."""
    this_cpu.cache_clear()
    monkeypatch.setattr(machines, "matmul_throughput", lambda *a, **k: 2.0)
    try:
        here = this_cpu(1)
        assert here.peak_flops == 2e9 and this_cpu(1) is here
    finally:
        this_cpu.cache_clear()
    assert here.dtype == torch.float32 and here.n_sms == torch.get_num_threads() and here.link_bytes_per_s is None
    assert here.bytes_per_s > 0 and here.launch_s > 0
    with pytest.raises(ValueError, match="repeats must be an int in"):
        this_cpu(0)
