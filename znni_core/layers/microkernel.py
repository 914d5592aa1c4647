"""The register tile every small product of znni runs on: ``rows x nv`` vectors of sums in registers.

A product ``C = A @ B`` of a few tens of channels is too small for BLAS to run well: OpenBLAS
pays for packing and for a kernel blocked for its own shapes, and on an AVX2 core its Haswell
kernel ran the Winograd layers' products 1.05-1.67x slower than code of the same ISA built here.
So, as BLIS's micro-kernels do, one tile of ``C`` (``rows`` rows x ``nv`` vectors of ``VL`` floats)
is summed over the inner dimension in registers and stored once::

    C[co + r*ldc + v] = act(bias[bo + r] + sum_k A[ao + r*ar + k*ac] * B[bo + k*ldb + v])

``A``'s values are broadcast (one per row and ``k``), ``B``'s rows are loaded as ``nv`` vectors;
``rows * nv`` accumulators, ``nv`` loads and one broadcast must fit the ISA's vector registers
(:data:`REGISTERS`: 32 with AVX-512, 16 with AVX2; a tile that does not fit spills, and that was
the gap between builds).  The 1x1x1 chains (``A`` the packed weights, ``B`` the voxels) and the
Winograd layers' products (``A`` a block of transformed tiles, ``B`` the transformed kernel)
both run on it.

The tile is LLVM IR (a numba intrinsic: ``<VL x float>`` loads, splats and ``llvm.fma``; ``rows``
and ``nv`` are compile-time constants of each call site), so it is built for the ISA numba
targets (:mod:`.vector_width`).  ``tests/test_microkernel.py`` checks every shape against a
float64 product, under each ISA build.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from ._numba import njit, numba
from .layout import copy_run, fill_run

__all__ = [
    "REGISTERS",
    "SHAPES",
    "VL",
    "Scratch",
    "batched_products",
    "fits",
    "fma_channels",
    "fma_taps",
    "fma_tile",
    "pad_columns",
    "tile_shape",
]


def _target_features() -> list:
    """The CPU features numba compiles for: ``NUMBA_CPU_FEATURES`` when set (then numba's cache
    keys on it too, so tiles and their cached loops always agree), else the host's, whatever
    ``NUMBA_CPU_NAME`` says (numba passes the host's features with any CPU name: an AVX2 build on
    an AVX-512 host needs ``NUMBA_CPU_FEATURES``, ``benchmarks/isa.py``)."""
    feats = numba.config.CPU_FEATURES
    return (feats if feats is not None else get_host_cpu_features()).split(",")


_FEATURES = _target_features()
#: floats per vector: 16 where numba targets AVX-512 at 512 bits, else 8 (AVX2, or AVX-512 with
#: 256-bit vectors preferred, :mod:`.vector_width`: LLVM then splits a 16-float vector in two,
#: and a tile of 8 x 2 such vectors spilled)
VL = 16 if "+avx512f" in _FEATURES and "+prefer-256-bit" not in _FEATURES else 8
#: vector registers: 32 with AVX-512 (at either width: ymm16-31 come with AVX-512VL), else 16
REGISTERS = 32 if "+avx512f" in _FEATURES else 16


def fits(rows: int, nv: int) -> bool:
    """True when a ``rows x nv`` tile's accumulators, ``nv`` loads of ``B`` and one broadcast fit the registers."""
    return rows * nv + nv + 1 <= REGISTERS


class _TileIR:
    """The parts every register tile's LLVM function shares: its vector type, constants, splats,
    vector pointers, the accumulators (started at the bias) and the store of each with the
    epilogue.  ``acc[r][j]`` are allocas of vectors (mem2reg makes them registers)."""

    def __init__(self, module, fn, R: int, NV: int, VL: int, bias):
        self.module, self.R, self.NV, self.VL = module, R, NV, VL
        self.f32, self.i64 = ir.FloatType(), ir.IntType(64)
        self.vt = ir.VectorType(self.f32, VL)
        self.builder = ir.IRBuilder(fn.append_basic_block("entry"))
        self.undef = ir.Constant(self.vt, ir.Undefined)
        self.lane0 = ir.Constant(ir.VectorType(ir.IntType(32), VL), [0] * VL)
        self.fma = cgutils.get_or_insert_function(
            module, ir.FunctionType(self.vt, [self.vt, self.vt, self.vt]), f"llvm.fma.v{VL}f32"
        )
        b = self.builder
        self.acc = []
        for r in range(R):
            br = self.splat(b.load(b.gep(bias, [self.const(r)])))
            row = [cgutils.alloca_once(b, self.vt) for _ in range(NV)]
            for x in row:
                b.store(br, x)
            self.acc.append(row)

    def const(self, v):
        return ir.Constant(self.i64, v)

    def splat(self, s):
        b = self.builder
        return b.shuffle_vector(b.insert_element(self.undef, s, ir.Constant(ir.IntType(32), 0)), self.undef, self.lane0)

    def vec(self, base, off):
        """The VL floats at ``base + off`` (an i64 value or an int) as a vector pointer."""
        off = self.const(off) if isinstance(off, int) else off
        return self.builder.bitcast(self.builder.gep(base, [off]), self.vt.as_pointer())

    def load_row(self, base, off):
        """The ``NV`` vectors from ``base + off`` (unaligned loads)."""
        b, out = self.builder, []
        for j in range(self.NV):
            v = b.load(self.vec(b.gep(base, [off]), j * self.VL))
            v.align = 4
            out.append(v)
        return out

    def fma_row(self, r, av, bv):
        """``acc[r][j] += av * bv[j]`` for every ``j``."""
        b = self.builder
        for j in range(self.NV):
            b.store(b.call(self.fma, [av, bv[j], b.load(self.acc[r][j])]), self.acc[r][j])

    def store(self, c, ldc, code, alpha):
        """Row ``r`` of the tile to ``c + r * ldc``, the epilogue ``code`` applied: 0 none, 1 ReLU,
        2 leaky ReLU of slope ``alpha``."""
        b = self.builder
        zero = ir.Constant(self.vt, [0.0] * self.VL)
        slope = self.splat(alpha)
        relu = b.icmp_signed("==", code, self.const(1))
        leaky = b.icmp_signed("==", code, self.const(2))
        for r in range(self.R):
            crow = b.gep(c, [b.mul(self.const(r), ldc)])
            for j in range(self.NV):
                v = b.load(self.acc[r][j])
                pos = b.fcmp_ordered(">", v, zero)
                out = b.select(relu, b.select(pos, v, zero), b.select(leaky, b.select(pos, v, b.fmul(v, slope)), v))
                s = b.store(out, self.vec(crow, j * self.VL))
                s.align = 4
        b.ret_void()


def _tile_function(module, R: int, NV: int, VL: int):
    """The tile as a function of its own in ``module`` (defined once per module): kept out of the
    loops that call it, its accumulators get the registers to themselves (inlined into a loop
    nest, LLVM spilled them to the stack)."""
    name = f"znni_fma_tile_{R}x{NV}x{VL}"  # a name per shape and width: one definition per module
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    f32, i64 = ir.FloatType(), ir.IntType(64)
    fp = f32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [fp, i64, i64, fp, i64, fp, i64, i64, fp, i64, f32]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    a, ar, ac, b, ldb, c, ldc, K, bias, code, alpha = fn.args
    for p in (a, b, c, bias):
        p.add_attribute("noalias")
    t = _TileIR(module, fn, R, NV, VL, bias)
    builder = t.builder
    arows = [builder.gep(a, [builder.mul(t.const(r), ar)]) for r in range(R)]
    with cgutils.for_range(builder, K) as loop:
        k = loop.index
        bv = t.load_row(b, builder.mul(k, ldb))
        kc = builder.mul(k, ac)
        for r in range(R):
            t.fma_row(r, t.splat(builder.load(builder.gep(arows[r], [kc]))), bv)
    t.store(c, ldc, code, alpha)
    return fn


def _taps_function(module, R: int, NV: int, VL: int):
    """The tile of a direct convolution (:func:`fma_taps`) as a function of its own in ``module``:
    its inner dimension is ``K1`` rows of ``B`` at the offsets ``offs`` (an input row per channel
    and kernel row), each read at ``K2`` shifts by one value (the kernel's taps along x)."""
    name = f"znni_fma_taps_{R}x{NV}x{VL}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    f32, i64 = ir.FloatType(), ir.IntType(64)
    fp, ip = f32.as_pointer(), i64.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [fp, i64, fp, ip, i64, i64, fp, i64, fp, i64, f32]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    a, ar, b, offs, K1, K2, c, ldc, bias, code, alpha = fn.args
    for p in (a, b, c, bias, offs):
        p.add_attribute("noalias")
    t = _TileIR(module, fn, R, NV, VL, bias)
    builder = t.builder
    arows = [builder.gep(a, [builder.mul(t.const(r), ar)]) for r in range(R)]
    with cgutils.for_range(builder, K1) as outer:
        k1 = outer.index
        brow = builder.gep(b, [builder.load(builder.gep(offs, [k1]))])
        ak = builder.mul(k1, K2)
        with cgutils.for_range(builder, K2) as inner:
            k2 = inner.index
            bv = t.load_row(brow, k2)
            kc = builder.add(ak, k2)
            for r in range(R):
                t.fma_row(r, t.splat(builder.load(builder.gep(arows[r], [kc]))), bv)
    t.store(c, ldc, code, alpha)
    return fn


def _channels_function(module, R: int, NV: int, VL: int, KX: int):
    """The tile of :func:`fma_channels` as a function of its own in ``module``: ``R`` output voxels
    of one channel, each ``NV`` vectors of sums along the input channels, summed across their lanes
    at the end.  Per kernel row each of the ``R + KX - 1`` input voxels is loaded once and feeds
    the ``KX`` sums it takes part in (a voxel's vectors straddle cache lines: loaded once per tap,
    the loads bound the tile at half the multiply-add rate)."""
    name = f"znni_fma_channels_{R}x{NV}x{VL}x{KX}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    f32, i64 = ir.FloatType(), ir.IntType(64)
    fp, ip = f32.as_pointer(), i64.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [fp, fp, ip, i64, i64, fp, i64, f32]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    w, x, offs, K1, C, c, ldc, bias = fn.args
    for p in (w, x, c, offs):
        p.add_attribute("noalias")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    vt = ir.VectorType(f32, VL)
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{VL}f32")

    def const(v):
        return ir.Constant(i64, v)

    def load(base, off):
        v = b.load(b.bitcast(b.gep(base, [off]), vt.as_pointer()))
        v.align = 4
        return v

    acc = [[cgutils.alloca_once(b, vt) for _ in range(NV)] for _ in range(R)]
    for row in acc:
        for a in row:
            b.store(ir.Constant(vt, [0.0] * VL), a)
    # the vectors' first channels: whole vectors, the last one ending with the voxel's channels
    first = [const(v * VL) for v in range(NV - 1)] + [b.sub(C, const(VL))]
    with cgutils.for_range(b, K1) as outer:
        k1 = outer.index
        row = b.gep(x, [b.load(b.gep(offs, [k1]))])
        wrow = b.gep(w, [b.mul(k1, const(KX * NV * VL))])
        wv = [[load(wrow, const((dx * NV + v) * VL)) for v in range(NV)] for dx in range(KX)]
        for m in range(R + KX - 1):
            voxel = b.mul(const(m), C)
            xv = [load(row, b.add(voxel, first[v])) for v in range(NV)]
            for dx in range(KX):
                r = m - dx
                if 0 <= r < R:
                    for v in range(NV):
                        b.store(b.call(fma, [wv[dx][v], xv[v], b.load(acc[r][v])]), acc[r][v])
    undef = ir.Constant(vt, ir.Undefined)
    for r in range(R):
        t = b.load(acc[r][0])
        for v in range(1, NV):
            t = b.fadd(t, b.load(acc[r][v]))
        width = VL
        while width > 1:  # halves added: lanes [0, width / 2) hold the sums
            width //= 2
            mask = [width + i if i < width else i for i in range(VL)]
            t = b.fadd(t, b.shuffle_vector(t, undef, ir.Constant(ir.VectorType(ir.IntType(32), VL), mask)))
        out = b.fadd(b.extract_element(t, ir.Constant(ir.IntType(32), 0)), bias)
        b.store(out, b.gep(c, [b.mul(const(r), ldc)]))
    b.ret_void()
    return fn


class _Args:
    """An intrinsic's arguments as its tile function takes them: ``idx(k)`` argument ``k`` as an
    int64, ``at(k, off)`` a pointer to element ``off`` of flat array ``k``, ``data(k)`` array
    ``k``'s data pointer, ``f32(k)`` a float32."""

    def __init__(self, context, builder, signature, args):
        self.context, self.builder, self.types, self.args = context, builder, signature.args, args

    def idx(self, k):
        return self.context.cast(self.builder, self.args[k], self.types[k], types.int64)

    def data(self, k):
        return self.context.make_array(self.types[k])(self.context, self.builder, self.args[k]).data

    def at(self, k, off):
        return self.builder.gep(self.data(k), [self.idx(off)])

    def f32(self, k):
        return self.context.cast(self.builder, self.args[k], self.types[k], types.float32)


def _literal_shape(rows, nv, vl):
    """``(rows, nv, vl)`` as ints when all three are compile-time constants, else None."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (rows, nv, vl)):
        return None
    return int(rows.literal_value), int(nv.literal_value), int(vl.literal_value)


@intrinsic
def fma_tile(typingctx, rows, nv, vl, a, ao, ar, ac, b, bo, ldb, c, co, ldc, K, bias, bio, code, alpha):
    """``fma_tile(rows, nv, vl, a, ao, ar, ac, b, bo, ldb, c, co, ldc, K, bias, bio, code, alpha)``: for
    ``r < rows`` and ``v < nv * vl``, ``c[co + r*ldc + v] = act(bias[bio + r] + sum_{k < K}
    a[ao + r*ar + k*ac] * b[bo + k*ldb + v])``; flat float32 arrays; ``rows``, ``nv`` and ``vl``
    (floats per vector: :data:`VL`, or 8 in a 512-bit build) constants; ``act`` the epilogue
    ``code``: 0 none, 1 ReLU, 2 leaky ReLU of slope ``alpha``."""
    shape = _literal_shape(rows, nv, vl)
    if shape is None:
        return None
    sig = types.void(rows, nv, vl, a, ao, ar, ac, b, bo, ldb, c, co, ldc, K, bias, bio, code, alpha)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        g = _Args(context, builder, signature, args)
        fn = _tile_function(builder.module, *shape)
        # a, ar, ac; b, ldb; c, ldc; K, bias, code, alpha
        builder.call(
            fn,
            [g.at(3, 4), g.idx(5), g.idx(6), g.at(7, 8), g.idx(9), g.at(10, 11), g.idx(12)]
            + [g.idx(13), g.at(14, 15), g.idx(16), g.f32(17)],
        )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fma_taps(typingctx, rows, nv, vl, a, ao, ar, b, bo, offs, K1, K2, c, co, ldc, bias, bio, code, alpha):
    """``fma_taps(rows, nv, vl, a, ao, ar, b, bo, offs, K1, K2, c, co, ldc, bias, bio, code, alpha)``:
    for ``r < rows`` and ``v < nv * vl``, ``c[co + r*ldc + v] = act(bias[bio + r] + sum_{k1 < K1,
    k2 < K2} a[ao + r*ar + k1*K2 + k2] * b[bo + offs[k1] + k2 + v])``: a direct convolution's
    output rows (``v`` along x) for ``rows`` output channels, its weights ``a`` (per channel
    ``K1 * K2`` taps), ``offs`` (int64) the input rows' offsets; flat arrays; ``rows``, ``nv``,
    ``vl`` constants; ``act`` as :func:`fma_tile`'s."""
    shape = _literal_shape(rows, nv, vl)
    if shape is None:
        return None
    sig = types.void(rows, nv, vl, a, ao, ar, b, bo, offs, K1, K2, c, co, ldc, bias, bio, code, alpha)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        g = _Args(context, builder, signature, args)
        fn = _taps_function(builder.module, *shape)
        # a, ar; b, offs, K1, K2; c, ldc; bias, code, alpha
        builder.call(
            fn,
            [g.at(3, 4), g.idx(5), g.at(6, 7), g.data(8), g.idx(9), g.idx(10), g.at(11, 12), g.idx(13)]
            + [g.at(14, 15), g.idx(16), g.f32(17)],
        )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fma_channels(typingctx, rows, nv, vl, kx, w, wo, x, xo, offs, K1, C, c, co, ldc, bias):
    """``fma_channels(rows, nv, vl, kx, w, wo, x, xo, offs, K1, C, c, co, ldc, bias)``: for ``r < rows``,
    ``c[co + r*ldc] = bias + sum_{k1 < K1, dx < kx, v < nv} w[wo + ((k1*kx + dx)*nv + v)*vl : +vl] .
    x[xo + offs[k1] + (r + dx)*C + f_v : +vl]``: one output channel of a direct convolution on a
    channels-last input (``C`` channels a voxel, ``vl <= C <= nv * vl``), ``rows`` voxels along x in
    registers, each ``nv`` vectors along the input channels (``f_v = v * vl``, the last vector
    ``C - vl``: it overlaps the one before, its weights zero on the lanes counted there), the
    lanes summed at the end; ``offs`` (int64) the kernel rows' input offsets; flat arrays;
    ``rows``, ``nv``, ``vl`` and ``kx`` (the kernel's taps along x) constants.  Unlike
    :func:`fma_taps` (vectors along x, channels first) it reads a voxel's channels as whole
    vectors: the last layer of a U-Net, a few output channels of a channels-last decoder, needs no
    transposition."""
    shape = _literal_shape(rows, nv, vl)
    if shape is None or not isinstance(kx, types.IntegerLiteral):
        return None
    shape += (int(kx.literal_value),)
    sig = types.void(rows, nv, vl, kx, w, wo, x, xo, offs, K1, C, c, co, ldc, bias)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        g = _Args(context, builder, signature, args)
        fn = _channels_function(builder.module, *shape)
        builder.call(fn, [g.at(4, 5), g.at(6, 7), g.data(8), g.idx(9), g.idx(10), g.at(11, 12), g.idx(13), g.f32(14)])
        return context.get_dummy_value()

    return sig, codegen


# ----------------------------------------------------------------------------- batched products
#: the tile shapes ``(rows, nv, vl)`` of :func:`batched_products`: per vector width (:data:`VL`, and
#: 8 floats too in a 512-bit build: 24 or 40 columns are whole 8-float tiles) and ``nv`` in 1-5,
#: the most rows that fit the registers
WIDTHS = (VL, 8) if VL == 16 else (VL,)
SHAPES = tuple((max(1, (REGISTERS - 1 - nv) // nv), nv, vl) for vl in WIDTHS for nv in range(1, 6))
_RMAX = max(r for r, _, _ in SHAPES)
_S = SHAPES + SHAPES[:5] * (2 - len(WIDTHS))  # ten entries either way: the dispatch below names ten
(_A0, _B0, _C0), (_A1, _B1, _C1), (_A2, _B2, _C2), (_A3, _B3, _C3), (_A4, _B4, _C4) = _S[:5]
(_A5, _B5, _C5), (_A6, _B6, _C6), (_A7, _B7, _C7), (_A8, _B8, _C8), (_A9, _B9, _C9) = _S[5:]


def tile_shape(n_cols: int, wide: bool = False) -> tuple:
    """``(rows, nv, vl)`` for products of ``n_cols`` columns: the fewest padded columns, then the
    wider vectors, then the most sums per value loaded (``rows * nv / (rows + nv)``: a tall thin
    tile is bound by its broadcasts).  ``wide``: the fewest vectors per row first (16-float vectors
    padded rather than 8-float ones exact: where a 16-float multiply-add costs what an 8-float one
    does, ``winograd.wide_tiles`` in :mod:`.tuning`), then as above."""
    n = max(1, int(n_cols))

    def cost(shape):
        r, nv, vl = shape
        w = nv * vl
        tiles = -(-n // w)
        return ((tiles * nv,) if wide else ()) + (tiles * w, -vl, -r * nv / (r + nv))

    return min(SHAPES, key=cost)


def padded_columns(n_cols: int, shape: tuple | None = None, wide: bool = False) -> int:
    """``n_cols`` rounded up to whole tiles of ``shape`` (:func:`tile_shape`'s, ``wide`` or not, by
    default): the row length of ``B`` and, to write no column through the scratch tile, of ``C``."""
    _, nv, vl = tile_shape(n_cols, wide) if shape is None else shape
    return -(-int(n_cols) // (nv * vl)) * nv * vl


@njit(nogil=True, cache=True, inline="always")
def _tile(s, a, ao, ar, b, bo, ldb, c, co, ldc, K, zb):  # pragma: no cover - compiled
    """One tile of shape ``SHAPES[s]``, no bias, no activation."""
    if s == 0:
        fma_tile(_A0, _B0, _C0, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 1:
        fma_tile(_A1, _B1, _C1, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 2:
        fma_tile(_A2, _B2, _C2, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 3:
        fma_tile(_A3, _B3, _C3, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 4:
        fma_tile(_A4, _B4, _C4, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 5:
        fma_tile(_A5, _B5, _C5, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 6:
        fma_tile(_A6, _B6, _C6, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 7:
        fma_tile(_A7, _B7, _C7, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    elif s == 8:
        fma_tile(_A8, _B8, _C8, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)
    else:
        fma_tile(_A9, _B9, _C9, a, ao, ar, 1, b, bo, ldb, c, co, ldc, K, zb, 0, 0, 0.0)


@njit(nogil=True, cache=True)
def _products(A, sa, ra, B, C, sc, rc, ldc, t0, t1, n, K, N, Np, sh, R, W, As, Cs, zb):  # pragma: no cover - compiled
    """C[t, :n, :N] = A[t, :n, :K] @ B[t, :K, :N] for t in [t0, t1) on tiles ``SHAPES[sh]`` (``R``
    rows, ``W`` columns); flat arrays: ``A`` ``sa`` floats per t, ``ra`` rows of ``K``; ``C`` ``sc``
    floats per t, ``rc`` rows of ``ldc``; ``B`` (T, K, Np), zero columns from ``N``.  A tile reads
    whole rows of ``A`` and writes whole rows and tiles of ``C`` where the buffers hold them (rows
    from ``n``, columns from ``N``: padding); past a buffer's end it goes through the scratch tiles
    ``As`` and ``Cs``."""
    for t in range(t0, t1):
        a0, b0, c0 = t * sa, t * K * Np, t * sc
        for r0 in range(0, n, R):
            rows = min(R, n - r0)
            src, so = A, a0 + r0 * K
            if r0 + R > ra:  # the last rows, padded with zero rows
                copy_run(As, 0, A, so, rows * K)
                fill_run(As, rows * K, R * K, np.float32(0.0))
                src, so = As, 0
            for o0 in range(0, N, W):
                if r0 + R <= rc and o0 + W <= ldc:
                    _tile(sh, src, so, K, B, b0 + o0, Np, C, c0 + r0 * ldc + o0, ldc, K, zb)
                else:
                    cols = min(W, N - o0)
                    _tile(sh, src, so, K, B, b0 + o0, Np, Cs, 0, W, K, zb)
                    for r in range(rows):
                        copy_run(C, c0 + (r0 + r) * ldc + o0, Cs, r * W, cols)


def pad_columns(B, shape: tuple | None = None):
    """``B`` (T, K, N) float32 with zero columns up to :func:`padded_columns` (its tiles' loads stay inside)."""
    T, K, N = B.shape
    out = np.zeros((T, K, padded_columns(N, shape)), np.float32)
    out[:, :, :N] = B
    return out


class Scratch:
    """One worker's tail tiles for :func:`batched_products` of ``K`` inner and ``N`` output columns."""

    def __init__(self, K: int, N: int, shape: tuple | None = None):
        self.shape = tile_shape(N) if shape is None else tuple(shape)
        if self.shape not in SHAPES:
            raise ValueError(f"tile shape {self.shape}: one of {SHAPES}")
        self.K = int(K)
        r, nv, vl = self.shape
        self.A = np.zeros(r * int(K), np.float32)
        self.C = np.zeros(r * nv * vl, np.float32)
        self.zero = np.zeros(_RMAX, np.float32)


def batched_products(A, B, C, n, N, scratch: Scratch, t0=0, t1=None):
    """``C[t, :n, :N] = A[t, :n] @ B[t, :, :N]`` for ``t`` in ``[t0, t1)``, on the caller's thread:
    ``A`` (T, rows, K) and ``C`` (T, rows, ldc) C-contiguous float32, ``B`` from :func:`pad_columns`
    for the scratch's tile shape.  Rows of ``C`` from ``n`` and columns from ``N`` may be written
    (padding: give ``C`` whole tiles, :func:`padded_columns`, and no value goes through the scratch)."""
    T, ra, K = A.shape
    rc, ldc = C.shape[1], C.shape[2]
    r, nv, vl = scratch.shape
    if (
        scratch.K != K
        or B.shape[:2] != (T, K)
        or B.shape[2] % (nv * vl)
        or B.shape[2] < N
        or ldc < N
        or n > min(ra, rc)
    ):
        raise ValueError(
            f"products of {A.shape} and {B.shape} into {C.shape} (scratch for K={scratch.K}, tiles {scratch.shape})"
        )
    t1 = T if t1 is None else t1
    sh = SHAPES.index(scratch.shape)
    _products(
        A.reshape(-1), ra * K, ra, B.reshape(-1), C.reshape(-1), rc * ldc, rc, ldc,
        t0, t1, n, K, N, B.shape[2], sh, r, nv * vl, scratch.A, scratch.C, scratch.zero,
    )  # fmt: skip
