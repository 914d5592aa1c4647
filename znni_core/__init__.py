"""znni: exact dense sliding-window inference of 3D ConvNets (ZNNi in Python).

>>> import znni_core
>>> net = znni_core.load_network("net.onnx")          # doctest: +SKIP
>>> out = znni_core.infer(net, volume, memory_budget=2**30)   # doctest: +SKIP
"""

from .errors import ZnniError
from .net import Network, load_network, save_network
from .version import __version__


def infer(net, x, *, device="cpu", memory_budget=None, plan=None, progress=None, cache=None):
    """Dense sliding-window output; see :func:`znni_core.inference.infer`."""
    # lazy: loads numba and scipy only when called
    from .inference import infer as _infer

    return _infer(net, x, device=device, memory_budget=memory_budget, plan=plan, progress=progress, cache=cache)


def release_cache():
    """Free the FFT kernel spectra ``infer`` keeps for its next call; see
    :func:`znni_core.inference.release_cache`."""
    # lazy: loads numba and scipy only when called
    from .inference import release_cache as _release

    _release()


__all__ = ["Network", "ZnniError", "infer", "load_network", "release_cache", "save_network", "__version__"]
