"""U-Nets of the kinds labs train, built in PyTorch for the graph-network tests.

``UNet(valid=True)`` is a MALA-style valid U-Net (unpadded convolutions, encoder maps
centre-cropped to the decoder's shape before concatenation); ``valid=False`` is a
zero-padded U-Net (RSUNet / PyTorch Connectomics style).  Options: depth, kernel,
anisotropic pooling, widths, nearest / transposed-convolution / trilinear upsampling,
BatchNorm, concatenation or addition skips, strided-convolution downsampling.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn


def _crop(x, like):
    o = [(a - b) // 2 for a, b in zip(x.shape[2:], like.shape[2:])]
    return x[:, :, o[0] : o[0] + like.shape[2], o[1] : o[1] + like.shape[3], o[2] : o[2] + like.shape[4]]


class UNet(nn.Module):
    def __init__(
        self,
        *,
        valid=True,
        depth=2,
        kernel=(3, 3, 3),
        pool=(1, 2, 2),
        width=4,
        c_in=1,
        c_out=2,
        up="nearest",
        bn=False,
        merge="concat",
        down="maxpool",
        act="relu",
    ):
        super().__init__()
        self.valid, self.merge, self.depth = valid, merge, depth
        pad = tuple(0 if valid else k // 2 for k in kernel)
        acts = {"relu": nn.ReLU, "elu": nn.ELU, "leaky": lambda: nn.LeakyReLU(0.1)}

        def block(ci, co):
            layers = [nn.Conv3d(ci, co, kernel, padding=pad)]
            if bn:
                layers.append(nn.BatchNorm3d(co))
            return nn.Sequential(*layers, acts[act](), nn.Conv3d(co, co, kernel, padding=pad), acts[act]())

        widths = [width * 2**i for i in range(depth + 1)]
        self.enc = nn.ModuleList([block(c_in if i == 0 else widths[i - 1], widths[i]) for i in range(depth)])
        if down == "maxpool":
            self.down = nn.ModuleList([nn.MaxPool3d(pool) for _ in range(depth)])
        else:  # strided convolution, kernel = stride
            self.down = nn.ModuleList([nn.Conv3d(widths[i], widths[i], pool, stride=pool) for i in range(depth)])
        self.mid = block(widths[depth - 1], widths[depth])
        ups = []
        for i in reversed(range(depth)):
            if up == "transpose":
                ups.append(nn.ConvTranspose3d(widths[i + 1], widths[i], pool, stride=pool))
            else:
                mode = {"nearest": "nearest", "linear": "trilinear"}[up]
                kw = {} if mode == "nearest" else {"align_corners": False}
                ups.append(
                    nn.Sequential(
                        nn.Upsample(scale_factor=pool, mode=mode, **kw), nn.Conv3d(widths[i + 1], widths[i], 1)
                    )
                )
        self.ups = nn.ModuleList(ups)
        self.dec = nn.ModuleList(
            [block(widths[i] * (2 if merge == "concat" else 1), widths[i]) for i in reversed(range(depth))]
        )
        self.head = nn.Sequential(nn.Conv3d(widths[0], c_out, 1), nn.Sigmoid())

    def forward(self, x):
        skips = []
        for enc, down in zip(self.enc, self.down):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.mid(x)
        for up, dec, skip in zip(self.ups, self.dec, reversed(skips)):
            x = up(x)
            skip = _crop(skip, x) if self.valid else skip
            x = torch.cat([skip, x], 1) if self.merge == "concat" else skip + x
            x = dec(x)
        return self.head(x)


def randomise_bn(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm3d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    return model.eval()


def export(model, path, shape, c_in=1, dynamic=False):
    """``model`` as ONNX at input ``shape`` (z, y, x); ``dynamic``: with dynamic batch and
    spatial axes, as most users export (shape arithmetic stays in the graph)."""
    axes = {0: "n", 2: "z", 3: "y", 4: "x"}
    kw = {"input_names": ["x"], "output_names": ["y"], "dynamic_axes": {"x": axes, "y": axes}} if dynamic else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), torch.zeros((1, c_in) + tuple(shape)), str(path), dynamo=False, **kw)
    return path


def run(model, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.ascontiguousarray(x[None]))).numpy()[0]


def admissible(model: UNet, axis: int, at_least: int) -> int:
    """The smallest input length >= ``at_least`` on ``axis`` that ``model`` runs on without
    flooring (an independent walk of the architecture, not znni's geometry)."""
    k = model.enc[0][0].kernel_size[axis]
    p = model.down[0].kernel_size if isinstance(model.down[0], nn.MaxPool3d) else model.down[0].kernel_size
    p = p[axis] if isinstance(p, tuple) else p
    shrink = 0 if not model.valid else 2 * (k - 1)
    for n in range(at_least, at_least + 4096):
        m, ok, sizes = n, True, []
        for _ in range(model.depth):
            m -= shrink
            sizes.append(m)
            if m < p or m % p:
                ok = False
                break
            m //= p
        m -= shrink
        if not ok or m < 1:
            continue
        for s in reversed(sizes):
            m = m * p
            if m > s:
                ok = False
                break
            m -= shrink
        if ok and m >= 1:
            return n
    raise ValueError("no admissible length")


class HalfCrop(nn.Module):
    """A crop whose size depends on the input's (half of x): no tiling can reproduce it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv3d(1, 2, 3)

    def forward(self, x):
        y = self.a(x)
        return y[..., : y.shape[-1] // 2]


class CropUNet(nn.Module):
    """A valid U-Net as labs write it: unpadded 3x3x3 convolutions, each skip centre-cropped
    with ``s[..., a:-a, b:-b, c:-c]`` where ``a, b, c`` are computed from the tensors' shapes in
    ``forward`` (with dynamic axes, that arithmetic stays in the exported graph)."""

    def __init__(self, depth=2, pool=(1, 2, 2), width=2, c_in=1, c_out=2, up="transpose"):
        super().__init__()
        self.depth, self.pool = depth, pool

        def block(ci, co):
            return nn.Sequential(nn.Conv3d(ci, co, 3), nn.ReLU(), nn.Conv3d(co, co, 3), nn.ReLU())

        widths = [width * 2**i for i in range(depth + 1)]
        self.enc = nn.ModuleList([block(c_in if i == 0 else widths[i - 1], widths[i]) for i in range(depth)])
        self.down = nn.ModuleList([nn.MaxPool3d(pool) for _ in range(depth)])
        self.mid = block(widths[depth - 1], widths[depth])
        if up == "transpose":
            ups = [nn.ConvTranspose3d(widths[i + 1], widths[i], pool, stride=pool) for i in reversed(range(depth))]
        else:
            ups = [
                nn.Sequential(nn.Upsample(scale_factor=pool, mode="nearest"), nn.Conv3d(widths[i + 1], widths[i], 1))
                for i in reversed(range(depth))
            ]
        self.ups = nn.ModuleList(ups)
        self.dec = nn.ModuleList([block(2 * widths[i], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv3d(widths[0], c_out, 1)

    def forward(self, x):
        skips = []
        for enc, down in zip(self.enc, self.down):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.mid(x)
        for up, dec, s in zip(self.ups, self.dec, reversed(skips)):
            x = up(x)
            a, b, c = ((p - q) // 2 for p, q in zip(s.shape[2:], x.shape[2:]))
            x = dec(torch.cat([s[..., a:-a, b:-b, c:-c], x], 1))
        return self.head(x)

    def admissible(self, axis: int, at_least: int) -> int:
        """The smallest input length >= ``at_least`` on ``axis`` that runs without flooring."""
        p = self.pool[axis]
        for n in range(at_least, at_least + 4096):
            m, ok = n, True
            for _ in range(self.depth):
                m -= 4
                ok = ok and m >= p and m % p == 0
                m //= p
            m -= 4
            for _ in range(self.depth):
                m = m * p - 4
            if ok and m >= 1:
                return n
        raise ValueError("no admissible length")


class PadUNet(nn.Module):
    """A padded U-Net in the style of milesial/Pytorch-UNet: same-padded convolutions, and the
    upsampled map zero-padded to its skip's size with ``F.pad`` (the differences computed from
    the shapes in ``forward``), then concatenated; softmax over channels."""

    def __init__(self, pool=(1, 2, 2), width=2, c_in=1, c_out=2):
        super().__init__()
        self.pool = pool
        self.a = nn.Sequential(nn.Conv3d(c_in, width, 3, padding=1), nn.ReLU())
        self.b = nn.Sequential(nn.Conv3d(width, 2 * width, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose3d(2 * width, width, pool, stride=pool)
        self.c = nn.Sequential(nn.Conv3d(2 * width, c_out, 3, padding=1), nn.Softmax(dim=1))

    def forward(self, x):
        s = self.a(x)
        u = self.up(self.b(nn.functional.max_pool3d(s, self.pool)))
        dz, dy, dx = (p - q for p, q in zip(s.shape[2:], u.shape[2:]))
        u = nn.functional.pad(u, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2, dz // 2, dz - dz // 2])
        return self.c(torch.cat([s, u], 1))


def chain_model(c_in=1, c_out=2):
    """A boundary-detector-like chain: valid convolutions, max-pooling (anisotropic and
    isotropic), activations."""
    return nn.Sequential(
        nn.Conv3d(c_in, 3, (1, 3, 3)),
        nn.ReLU(),
        nn.MaxPool3d((1, 2, 2)),
        nn.Conv3d(3, 4, 3),
        nn.ELU(),
        nn.MaxPool3d(2),
        nn.Conv3d(4, 3, (1, 3, 3)),
        nn.Tanh(),
        nn.Conv3d(3, c_out, 1),
        nn.Sigmoid(),
    )


def export_as(model, path, shape, exporter="legacy", dynamic=None, c_in=1):
    """``model`` as ONNX, exported at input ``shape`` (z, y, x) the way users export today:

    * ``exporter="legacy"``: ``torch.onnx.export(model, x, path, dynamo=False[, dynamic_axes=...])``
    * ``exporter="dynamo"``: ``torch.onnx.export(model, (x,), path, dynamo=True[, dynamic_shapes=...])``

    ``dynamic``: None (static shapes), ``"axes"`` (``dynamic_axes`` on batch, z, y, x), ``"batch"``
    (on the batch axis only: ``dynamic_axes`` for the legacy exporter, ``dynamic_shapes`` for dynamo)
    or, with dynamo, ``"shapes"`` (``dynamic_shapes`` with ``torch.export.Dim.AUTO`` on z, y, x)."""
    x = torch.zeros((1, c_in) + tuple(shape))
    axes = {0: "n", 2: "z", 3: "y", 4: "x"}
    auto = torch.export.Dim.AUTO
    kw = {}
    if dynamic == "axes":
        kw = {"input_names": ["x"], "output_names": ["y"], "dynamic_axes": {"x": axes, "y": axes}}
    elif dynamic == "batch" and exporter == "legacy":
        kw = {"input_names": ["x"], "output_names": ["y"], "dynamic_axes": {"x": {0: "n"}, "y": {0: "n"}}}
    elif dynamic == "batch":
        kw = {"dynamic_shapes": ({0: auto},)}
    elif dynamic == "shapes":
        kw = {"dynamic_shapes": ({2: auto, 3: auto, 4: auto},)}
    elif dynamic is not None:
        raise ValueError(f"dynamic={dynamic!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            if dynamic == "shapes":
                raise ValueError("the legacy exporter takes dynamic_axes, not dynamic_shapes")
            torch.onnx.export(model.eval(), x, str(path), dynamo=False, **kw)
        elif exporter == "dynamo":
            torch.onnx.export(model.eval(), (x,), str(path), dynamo=True, verbose=False, **kw)
        else:
            raise ValueError(f"exporter={exporter!r}")
    return path
