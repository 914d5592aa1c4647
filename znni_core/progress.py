"""Progress bars for long commands: a rate and an ETA on a terminal, nothing when the output is a
file or a pipe (a job's log, CI), so logs stay line-oriented.

>>> with bar(3, "demo", "step") as b:
...     for _ in range(3):
...         b.update(1)
"""

from __future__ import annotations

import sys


def bar(total: int | None, desc: str, unit: str = "it", *, stream=None):
    """A ``tqdm`` bar over ``total`` units (None: counts, no ETA) on ``stream`` (stderr), disabled
    unless it is a terminal; use as a context manager and call ``update(n)``."""
    # lazy: loads tqdm only when called
    from tqdm import tqdm

    stream = sys.stderr if stream is None else stream
    quiet = not getattr(stream, "isatty", lambda: False)()
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=stream, disable=quiet, dynamic_ncols=True)
