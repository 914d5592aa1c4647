"""FFTW wisdom round trip, without pickle."""

import json

import numpy as np
import pyfftw
import pytest

from znni_core.errors import InputError
from znni_core.layers import FFTConv, default_wisdom_path, load_wisdom, save_wisdom


def _plan(flags):
    a = pyfftw.empty_aligned((6, 30, 42), dtype=np.complex64)
    return pyfftw.FFTW(a, a, axes=(-2,), flags=flags)


def test_round_trip_through_default_path(tmp_path, monkeypatch):
    monkeypatch.setenv("ZNNI_CACHE_DIR", str(tmp_path / "cache"))
    assert default_wisdom_path() == tmp_path / "cache" / "fftw_wisdom.json"
    assert load_wisdom() is None  # nothing saved yet
    _plan(("FFTW_MEASURE",))
    w = np.ones((2, 2, 3, 3, 3), np.float32)
    FFTConv(w, None, (11, 13, 10), effort="measure")(np.ones((1, 2, 11, 13, 10), np.float32))
    saved = pyfftw.export_wisdom()
    path = save_wisdom()
    assert path == default_wisdom_path() and json.loads(path.read_text())["format"].startswith("znni")
    pyfftw.forget_wisdom()
    with pytest.raises(RuntimeError):  # no wisdom for it any more
        _plan(("FFTW_MEASURE", "FFTW_WISDOM_ONLY"))
    assert load_wisdom()[1] is True
    _plan(("FFTW_MEASURE", "FFTW_WISDOM_ONLY"))  # planned from the loaded wisdom
    # same entries (FFTW may export them in another order)
    assert sorted(pyfftw.export_wisdom()[1].splitlines()) == sorted(saved[1].splitlines())


def test_explicit_path_and_malformed_file(tmp_path):
    p = save_wisdom(tmp_path / "w.json")
    assert load_wisdom(p) is not None
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\x80\x04pickle")
    with pytest.raises(InputError, match="not a znni FFTW wisdom"):
        load_wisdom(bad)
