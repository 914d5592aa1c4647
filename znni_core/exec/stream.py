"""Convolution blocks streamed between host memory and the device (GPU + host RAM plans).

A layer's input and output stay in host RAM; block ``j`` of the input is copied to the
device on the copy stream while block ``j - 1`` computes on the compute stream, and
each result is copied back on the copy stream once its compute has finished (events
order the two streams).  Host staging buffers are pinned (page-locked), two per side:
a buffer is refilled only after the copy that read it has completed.  On the simulated
GPU the streams are no-ops and everything runs in order; the result is the same.

A block's device input and output are kept until the copy back of its result has finished:
CuPy's pool may hand a freed block to the next allocation while another stream still reads
it.  At most two blocks' inputs and outputs are alive (``plan.memory.device_call_bytes``).
"""

from __future__ import annotations

import numpy as np

from ..layers.layout import copy_into
from ..layers.xp import empty_pinned


def stream_blocks(fn, x: np.ndarray, out: np.ndarray, jobs, xp) -> None:
    """``out[dst] = fn(x[src])`` for every ``(src, dst)`` in ``jobs``, ``fn`` running on the device."""
    copy, compute = xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True)
    staged_in, staged_out = {}, {}  # shape -> two pinned buffers

    def pinned(cache, shape, j):
        bufs = cache.get(shape)
        if bufs is None:
            bufs = cache[shape] = [empty_pinned(xp, shape) for _ in range(2)]
        return bufs[j % 2]

    read = {}  # pinned input buffer -> the event of the copy that reads it

    def upload(j):
        src = jobs[j][0]
        block = x[src]
        host = pinned(staged_in, block.shape, j)
        if id(host) in read:
            read[id(host)].synchronize()  # its previous copy to the device has finished
        copy_into(host, block)  # in parallel; also makes an overlap-save block contiguous
        dev = xp.empty(block.shape, dtype=np.float32)
        dev.set(host, stream=copy)
        done = read[id(host)] = xp.cuda.Event()
        done.record(copy)
        return dev, done

    def finish(pending):
        dst, host, copied, _ = pending  # _: the block's device arrays, freed once its copy is done
        copied.synchronize()
        copy_into(out[dst], host)

    pending = None  # the previous block: (dst, host buffer, event of its copy back, device arrays)
    nxt = upload(0) if jobs else None
    for j in range(len(jobs)):
        dev, uploaded = nxt
        compute.wait_event(uploaded)
        with compute:
            y = fn(dev)
        computed = xp.cuda.Event()
        computed.record(compute)
        if pending is not None:
            finish(pending)
            pending = None
        if j + 1 < len(jobs):
            nxt = upload(j + 1)  # overlaps this block's compute
        copy.wait_event(computed)
        host = pinned(staged_out, tuple(y.shape), j)
        y.get(stream=copy, out=host, blocking=False)
        copied = xp.cuda.Event()
        copied.record(copy)
        pending = (jobs[j][1], host, copied, (dev, y))
        del dev, y
    if pending is not None:
        finish(pending)
