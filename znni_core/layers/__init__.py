"""Layer primitives on batched 5-D float32 arrays ``(N, C, Z, Y, X)``.

Each primitive is written once against an array module ``xp`` (numpy or CuPy,
see :mod:`.xp`); pyfftw and numba are CPU fast paths.  ``layers`` knows arrays
only: no network, plan or IO imports.

Convolutions (PyTorch ``Conv3d`` semantics: correlation, valid, stride 1):
:func:`conv_direct_gemm`, :func:`conv_direct_numba`, :class:`FFTConv` /
:func:`fft_conv`, :class:`FFTGemmConv` (channel sums as per-frequency GEMMs),
:class:`WinogradConv` (kernels of 1-3 in z, 1-5 in y and x: channel sums as per-position GEMMs).
Pooling: :func:`max_pool`, :func:`mpf`, :func:`recombine`,
:func:`max_filter_dense`.  Activations: :func:`apply_activation`.

Every primitive has a ``*_memory`` function predicting the peak bytes a call
allocates, output included, input excluded.
"""

from . import microkernel, tuning, vector_width
from .activation import ACTIVATIONS, activation_memory, apply_activation
from .direct import (
    conv_direct_gemm,
    conv_direct_gemm_memory,
    conv_direct_numba,
    conv_direct_numba_memory,
    conv_out_shape,
    direct_numba_efficiency,
    direct_numba_tiles,
)
from .fft import (
    FFTConv,
    default_wisdom_path,
    fft_conv,
    fft_conv_memory,
    fft_kernel_cache_bytes,
    fft_shape,
    fft_size,
    load_wisdom,
    pruned_rfftn,
    save_wisdom,
)
from .fft_gemm import FFTGemmConv, fft_gemm_kernel_bytes, fft_gemm_memory, fft_gemm_sizes, fft_gemm_transform_shape
from .pointwise import conv_pointwise_chain
from .pool import (
    fragment_of_filtered,
    gather_fragment,
    max_filter_dense,
    max_filter_inplace,
    max_pool,
    max_pool_memory,
    mpf,
    mpf_memory,
    mpf_shape,
    recombine,
    recombine_memory,
)
from .winograd import (
    WinogradConv,
    winograd_kernel_bytes,
    winograd_memory,
    winograd_sizes,
    winograd_supports,
    winograd_tiles,
)
from .xp import cupy_or_none, get_array_module

__all__ = [
    "ACTIVATIONS",
    "microkernel",
    "tuning",
    "vector_width",
    "FFTConv",
    "FFTGemmConv",
    "WinogradConv",
    "activation_memory",
    "apply_activation",
    "conv_direct_gemm",
    "conv_direct_gemm_memory",
    "conv_pointwise_chain",
    "conv_direct_numba",
    "conv_direct_numba_memory",
    "conv_out_shape",
    "cupy_or_none",
    "direct_numba_efficiency",
    "direct_numba_tiles",
    "default_wisdom_path",
    "fft_conv",
    "fft_conv_memory",
    "fft_gemm_kernel_bytes",
    "fft_gemm_memory",
    "fft_gemm_sizes",
    "fft_gemm_transform_shape",
    "fft_kernel_cache_bytes",
    "fft_shape",
    "fft_size",
    "get_array_module",
    "load_wisdom",
    "fragment_of_filtered",
    "gather_fragment",
    "max_filter_dense",
    "max_filter_inplace",
    "max_pool",
    "max_pool_memory",
    "mpf",
    "mpf_memory",
    "mpf_shape",
    "recombine",
    "recombine_memory",
    "pruned_rfftn",
    "save_wisdom",
    "winograd_kernel_bytes",
    "winograd_memory",
    "winograd_sizes",
    "winograd_supports",
    "winograd_tiles",
]
