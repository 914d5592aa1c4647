"""apply_activation against torch.nn.functional."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from znni_core.errors import InputError
from znni_core.layers import apply_activation

REF = {
    "relu": lambda t, a: F.relu(t),
    "leaky_relu": lambda t, a: F.leaky_relu(t, a),
    "elu": lambda t, a: F.elu(t, a),
    "sigmoid": lambda t, a: torch.sigmoid(t),
    "tanh": lambda t, a: torch.tanh(t),
    "softmax": lambda t, a: torch.softmax(t, dim=1),
    "identity": lambda t, a: t,
}


@pytest.mark.parametrize("kind", sorted(REF))
@pytest.mark.parametrize("alpha", [0.1, 1.7])
@pytest.mark.parametrize("in_place", [False, True])
def test_matches_torch(kind, alpha, in_place):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 4, 3, 5, 6)) * 30).astype(np.float32)  # large values: overflow paths
    want = REF[kind](torch.from_numpy(x.copy()), alpha).numpy()
    y = apply_activation(x, kind, alpha, out=x if in_place else None)
    assert (y is x) == (in_place or kind == "identity")
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("kind", ["leaky_relu", "elu", "sigmoid"])
@pytest.mark.parametrize("in_place", [False, True])
def test_chunked_cpu_path_matches_torch(kind, in_place):
    """Large contiguous arrays run chunk by chunk on several workers (a last chunk that is
    short); the result is the whole-array one."""
    import numba

    from znni_core.layers.activation import CHUNK

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(5 * CHUNK + 77) * 4).astype(np.float32).reshape(1, 1, 1, 1, -1)
    want = REF[kind](torch.from_numpy(x.copy()), 0.3).numpy()
    old = numba.get_num_threads()
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    try:
        y = apply_activation(x, kind, 0.3, out=x if in_place else None)
    finally:
        numba.set_num_threads(old)
    assert (y is x) == in_place
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=2e-7)


def test_unknown_kind_is_refused():
    with pytest.raises(InputError, match="swish"):
        apply_activation(np.zeros((1, 1, 1, 1, 1), np.float32), "swish")
