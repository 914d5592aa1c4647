"""The same engine on CuPy (skipped without a CUDA device): GPU output == CPU output == torch."""

from __future__ import annotations

import numpy as np
import pytest

import znni_core
from znni_core.errors import DeviceError
from znni_core.layers.xp import require_device
from znni_core.plan import autotune

from .nets import NETS, make_net
from .reference import max_rel_err, torch_dense


@pytest.mark.gpu
@pytest.mark.parametrize("prim", ["direct-gemm", "fft-gemm", "fft-data", "winograd", "direct-torch"])
def test_gpu_matches_torch(prim):
    net = make_net(NETS["aniso"], c_in=2, seed=4)
    x = np.random.default_rng(0).standard_normal((2,) + tuple(f + 9 for f in net.field_of_view)).astype(np.float32)
    plan = autotune(net, device="gpu", memory_budget=2**30, primitives=(prim,))
    out = znni_core.infer(net, x, device="gpu", plan=plan)
    assert isinstance(out, np.ndarray)
    assert max_rel_err(out, torch_dense(net, x)) <= 1e-4


def test_gpu_request_without_device_is_a_clear_error():
    try:
        require_device("gpu")
    except DeviceError as exc:
        assert "device" in str(exc)
    else:
        pytest.skip("a CUDA device is present")
    with pytest.raises(DeviceError):
        require_device("tpu")


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["gpu", "cpu+gpu"])
def test_gpu_plan_kinds_match_the_cpu_and_keep_their_memory(device):
    """On a real device: GPU-only, GPU + host RAM (a budget the tensors do not fit) and the
    CPU -> GPU pipeline equal the CPU engine; the pool's peak stays within the budget."""
    cupy = pytest.importorskip("cupy")

    net = make_net(NETS["iso2pool"], seed=4)
    x = np.random.default_rng(1).standard_normal((1, 93, 93, 93)).astype(np.float32)
    ref = znni_core.infer(net, x)
    from znni_core.exec.device import PeakMeter

    for budget in (2**28, 8_000_000) if device == "gpu" else (2**28,):
        plan = autotune(net, device=device, memory_budget=budget, patch_shape=(93, 93, 93), use_cache=False)
        znni_core.release_cache()
        with PeakMeter(cupy) as meter:
            out = znni_core.infer(net, x, device=device, plan=plan)
        assert max_rel_err(out, ref) <= 1e-4, plan.describe()
        assert meter.peak <= budget + 2**26, (meter.peak, plan.describe())  # cuFFT plans: at most 64 MiB
        if plan.placement == "":
            assert abs(meter.peak - plan.predicted_peak_bytes) <= 0.25 * plan.predicted_peak_bytes, plan.describe()


@pytest.mark.gpu
def test_direct_torch_is_exact_after_pytorchs_own_work():
    """On the H100 ``direct-torch`` went wrong right after a PyTorch dense run on the device
    (``benchmarks/gpu.py``) and beside other processes; alone it was exact.  This replays the
    benchmark's order: PyTorch's dense module, its cache emptied, then znni's plan, three times."""
    torch = pytest.importorskip("torch")
    from benchmarks.runtimes import dense_module

    net = make_net(NETS["deep"], seed=2)
    x = np.random.default_rng(0).standard_normal((1,) + tuple(f + 13 for f in net.field_of_view)).astype(np.float32)
    ref = znni_core.infer(net, x)
    module = dense_module(net).cuda()
    plan = autotune(
        net, device="gpu", memory_budget=2**28, primitives=("direct-torch",), use_cache=False, input_shape=x.shape[1:]
    )
    for _ in range(3):
        with torch.no_grad():
            dense = module(torch.from_numpy(x[None]).cuda())[0].cpu().numpy()
        torch.cuda.empty_cache()
        assert max_rel_err(dense, ref) <= 1e-4
        znni_core.release_cache()
        assert max_rel_err(znni_core.infer(net, x, device="gpu", plan=plan), ref) <= 1e-4, plan.describe()
