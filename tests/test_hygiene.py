"""The test suite's own rules, checked on its source: no assertion that cannot fail (``assert x or
True``), no assertion on wall-clock time (a loaded CI machine makes it flaky, a fast one hides a
regression: bounds are asserted on counts, attempts and recorded waits)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns", "time_ns"}


def _is_clock_call(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CLOCKS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "time"
    )


def _has_clock_difference(node) -> bool:
    """``time.perf_counter() - t0`` and the like: a subtraction with a clock call in it."""
    return any(
        isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub) and any(_is_clock_call(m) for m in ast.walk(n))
        for n in ast.walk(node)
    )


def _always_true(node) -> bool:
    return (
        isinstance(node, ast.BoolOp)
        and isinstance(node.op, ast.Or)
        and any(isinstance(v, ast.Constant) and bool(v.value) for v in node.values)
    )


def offences(source: str, name: str = "<test>") -> list[str]:
    """``file:line: why`` for each assertion that cannot fail or compares a duration."""
    tree = ast.parse(source)
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
        durations = {
            t.id
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign) and _has_clock_difference(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for n in ast.walk(fn):
            if not isinstance(n, ast.Assert):
                continue
            if _always_true(n.test):
                out.append(f"{name}:{n.lineno}: assertion cannot fail (... or <true constant>)")
            for c in (m for m in ast.walk(n.test) if isinstance(m, ast.Compare)):
                sides = [c.left, *c.comparators]
                if any(isinstance(s, ast.Name) and s.id in durations for s in sides) or any(
                    _has_clock_difference(s) for s in sides
                ):
                    out.append(f"{name}:{n.lineno}: assertion on wall-clock time")
    return sorted(set(out))


def test_the_checks_catch_what_they_are_for():
    bad = (
        "import time\n"
        "def test_a():\n"
        "    t0 = time.perf_counter()\n"
        "    took = time.perf_counter() - t0\n"
        "    assert took < 5\n"
        "    assert time.{clock}() - t0 < 1, 'x'\n"
        "    assert ok(1) or True\n"
        "def test_b(t0):\n"
        "    assert changed_after(t0) and t0 < time.time()\n"  # an mtime check, not a duration
        "    assert sum([1]) == 1 or False\n"
    ).format(clock="monotonic")  # (kept out of this file's own text)
    assert offences(bad) == [
        "<test>:5: assertion on wall-clock time",
        "<test>:6: assertion on wall-clock time",
        "<test>:7: assertion cannot fail (... or <true constant>)",
    ]


@pytest.mark.parametrize("path", sorted(HERE.glob("*.py")), ids=lambda p: p.name)
def test_no_assertion_that_cannot_fail_and_none_on_wall_clock_time(path):
    assert offences(path.read_text(), path.name) == []
