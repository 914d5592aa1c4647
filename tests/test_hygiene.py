"""The test suite's own rules, checked on its source (an AST pass over every ``tests/*.py``).

No assertion that cannot fail:

* a constant, or an expression of constants (``assert "msg"``, ``assert (x, "msg")``, ``assert x or True``);
* a flag set to the same constant on every path (``ok = True`` in both branches of an ``if`` or a
  ``try``/``except``, then ``assert ok``);
* either outcome accepted (``assert a or not a``, ``assert x is None or x is not None``,
  ``assert x == x``, ``assert flag in (True, False)``, ``assert len(x) >= 0``);
* ``pytest.raises(Exception)`` / ``pytest.raises(BaseException)``: any error passes, a typo's
  ``NameError`` included.

No assertion on wall-clock time (a loaded CI machine makes it flaky, a fast one hides a regression:
bounds are asserted on counts, attempts and recorded waits): a difference of clock readings
(``time.time``, ``perf_counter``, ``monotonic``... however the clock was imported or aliased),
directly or through the names it was stored in, compared in an assertion.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CLOCKS = {
    "perf_counter",
    "perf_counter_ns",
    "time",
    "time_ns",
    "monotonic",
    "monotonic_ns",
    "process_time",
    "process_time_ns",
    "thread_time",
    "thread_time_ns",
}
BROAD = {"Exception", "BaseException"}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass
class Report:
    """What one pass checked and found."""

    files: int = 0
    asserts: int = 0
    raises: int = 0
    offences: list[str] = field(default_factory=list)


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


# ---------------------------------------------------------------------------------------------- clocks


class _Clocks:
    """How this file reaches the clocks: ``time`` under any name, ``from time import x as y``,
    ``clock = time.perf_counter``."""

    def __init__(self, tree: ast.AST):
        self.modules, self.funcs = set(), set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                self.modules |= {a.asname or a.name for a in n.names if a.name == "time"}
            elif isinstance(n, ast.ImportFrom) and n.module == "time":
                self.funcs |= {a.asname or a.name for a in n.names if a.name in CLOCKS}
        for n in ast.walk(tree):  # clock = time.perf_counter
            if isinstance(n, ast.Assign) and self.is_clock(n.value, call=False):
                self.funcs |= {t.id for t in n.targets if isinstance(t, ast.Name)}

    def is_clock(self, node, call=True) -> bool:
        if call:
            if not isinstance(node, ast.Call):
                return False
            node = node.func
        if isinstance(node, ast.Attribute):
            return node.attr in CLOCKS and isinstance(node.value, ast.Name) and node.value.id in self.modules
        return isinstance(node, ast.Name) and node.id in self.funcs


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _timing(fn, clocks: _Clocks):
    """(readings, durations): names holding a clock reading (``t0 = clock()``, ``deadline =
    time.time() + 5``) and names holding a difference of two readings or arithmetic on one,
    followed through assignments."""
    assigns = [
        (t.id, n.value)
        for n in ast.walk(fn)
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and n.value is not None
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    ]
    readings, durations = set(), set()
    while True:
        before = len(readings) + len(durations)
        for name, value in assigns:
            if _is_duration(value, clocks, readings, durations):
                durations.add(name)
            elif _is_reading(value, clocks, readings):
                readings.add(name)
        if len(readings) + len(durations) == before:
            return readings, durations


def _is_reading(node, clocks, readings) -> bool:
    """A clock call, a name holding one, or one shifted by something else (``time.time() - 1e-3``)."""
    if clocks.is_clock(node):
        return True
    if isinstance(node, ast.Name):
        return node.id in readings
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        a, b = (_is_reading(x, clocks, readings) for x in (node.left, node.right))
        return a != b
    return False


_ARITHMETIC = {"min", "max", "abs", "round", "float", "int", "sum", "sorted", "median", "mean"}


def _is_duration(node, clocks, readings, durations) -> bool:
    """A difference of two clock readings, or arithmetic on one (``(t1 - t0) / n``, ``max(took)``)."""

    def dur(n) -> bool:
        if isinstance(n, ast.Name):
            return n.id in durations
        if isinstance(n, ast.BinOp):
            if isinstance(n.op, ast.Sub) and all(_is_reading(x, clocks, readings) for x in (n.left, n.right)):
                return True
            return dur(n.left) or dur(n.right)
        if isinstance(n, ast.UnaryOp):
            return dur(n.operand)
        if isinstance(n, (ast.GeneratorExp, ast.ListComp)):
            return dur(n.elt)
        if isinstance(n, (ast.List, ast.Tuple)):
            return any(dur(e) for e in n.elts)
        if isinstance(n, ast.Call):
            f = n.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            return fname in _ARITHMETIC and any(dur(a) for a in n.args)
        return False

    return dur(node)


# ------------------------------------------------------------------------------ constants and flags


def _binds(stmts, name) -> bool:
    """``name`` bound on every path through ``stmts`` (loops may run no iteration)."""
    for s in stmts:
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if any(name in _names(t) for t in targets):
                return True
        elif isinstance(s, ast.If):
            if s.orelse and _binds(s.body, name) and _binds(s.orelse, name):
                return True
        elif isinstance(s, ast.Try):
            if _binds(s.finalbody, name) or (
                s.handlers and _binds(s.body + s.orelse, name) and all(_binds(h.body, name) for h in s.handlers)
            ):
                return True
        elif isinstance(s, (ast.With, ast.AsyncWith)) and _binds(s.body, name):
            return True
    return False


def _constant_flags(fn) -> dict[str, object]:
    """{name: value} for each local name of ``fn`` that every binding sets to the same constant, on
    every path (a flag assigned ``True`` in both branches): an assertion on it cannot fail."""
    values: dict[str, list] = {}
    for n in ast.walk(fn):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    values.setdefault(t.id, []).append(n.value)
                else:  # a, b = ...; x[i] = ...; x.a = ...: not a constant binding
                    for m in _names(t):
                        values.setdefault(m, []).append(None)
        elif isinstance(n, (ast.AugAssign, ast.For, ast.AsyncFor, ast.comprehension, ast.NamedExpr)):
            for m in _names(n.target):
                values.setdefault(m, []).append(None)
        elif isinstance(n, (ast.With, ast.AsyncWith)):
            for item in n.items:
                for m in _names(item.optional_vars) if item.optional_vars else ():
                    values.setdefault(m, []).append(None)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            values.setdefault(n.name, []).append(None)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            for m in n.names:
                values.setdefault(m, []).append(None)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                values.setdefault((a.asname or a.name).split(".")[0], []).append(None)
        elif isinstance(n, (ast.Delete)):
            for t in n.targets:
                for m in _names(t):
                    values.setdefault(m, []).append(None)
        elif isinstance(n, _SCOPES) and n is not fn:
            for a in ast.walk(n.args):
                if isinstance(a, ast.arg):
                    values.setdefault(a.arg, []).append(None)
    if isinstance(fn, _SCOPES):
        for a in ast.walk(fn.args):
            if isinstance(a, ast.arg):
                values.setdefault(a.arg, []).append(None)
    out = {}
    for name, vs in values.items():
        if all(isinstance(v, ast.Constant) for v in vs):
            first = vs[0].value
            if all(type(v.value) is type(first) and v.value == first for v in vs) and _binds(fn.body, name):
                out[name] = first
    return out


_UNKNOWN = object()
_NEGATED = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
}


def _value(node, flags):
    """The value of ``node`` if it is known without running the test, else ``_UNKNOWN``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in flags:
        return flags[node.id]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        return tuple(node.elts)  # truthy whatever its elements
    if isinstance(node, ast.Dict) and node.keys:
        return {0: 0}
    if isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.Constant) and v.value for v in node.values):
        return "f-string"
    if isinstance(node, ast.Lambda):
        return node
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = _value(node.operand, flags)
        return _UNKNOWN if v is _UNKNOWN else not v
    if isinstance(node, ast.BoolOp):
        vals = [_value(v, flags) for v in node.values]
        stop = (lambda v: bool(v)) if isinstance(node.op, ast.Or) else (lambda v: not v)
        for v in vals:  # short-circuit: the first deciding known operand decides, if all before it are known
            if v is _UNKNOWN:
                break
            if stop(v):
                return v
        else:
            return vals[-1]
        if isinstance(node.op, ast.Or) and any(v is not _UNKNOWN and v for v in vals):
            return True  # `x or True`: the assertion passes whatever x is
        return _UNKNOWN
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b = _value(node.left, flags), _value(node.comparators[0], flags)
        if a is _UNKNOWN or b is _UNKNOWN or isinstance(a, tuple) or isinstance(b, tuple):
            return _UNKNOWN
        op = node.ops[0]
        try:
            if isinstance(op, ast.Eq):
                return a == b
            if isinstance(op, ast.NotEq):
                return a != b
            if isinstance(op, ast.Is):
                return a is b
            if isinstance(op, ast.IsNot):
                return a is not b
        except Exception:  # noqa: BLE001 - an exotic constant: not known
            return _UNKNOWN
    return _UNKNOWN


def _negation(a, b) -> bool:
    """``b`` is ``not a`` (or ``a`` is ``not b``), or the opposite comparison of the same operands."""
    for x, y in ((a, b), (b, a)):
        if isinstance(y, ast.UnaryOp) and isinstance(y.op, ast.Not) and _same(x, y.operand):
            return True
    if isinstance(a, ast.Compare) and isinstance(b, ast.Compare) and len(a.ops) == len(b.ops) == 1:
        return (
            _NEGATED.get(type(a.ops[0])) is type(b.ops[0])
            and _same(a.left, b.left)
            and _same(a.comparators[0], b.comparators[0])
        )
    return False


def _either_outcome(test) -> str | None:
    """Why ``test`` accepts every outcome, or None."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        vals = test.values
        if any(_negation(x, y) for i, x in enumerate(vals) for y in vals[i + 1 :]):
            return "accepts a condition or its negation"
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, left, right = test.ops[0], test.left, test.comparators[0]
        pure = not any(isinstance(m, (ast.Call, ast.Await, ast.Yield, ast.NamedExpr)) for m in ast.walk(test))
        if pure and isinstance(op, (ast.Eq, ast.Is, ast.LtE, ast.GtE)) and _same(left, right):
            return "compares an expression with itself"
        if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            consts = {(type(e.value), e.value) for e in right.elts if isinstance(e, ast.Constant)}
            if {(bool, True), (bool, False)} <= consts:
                return "accepts both True and False"
        if (  # len(x) >= 0, len(x) > -1
            isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name)
            and left.func.id == "len"
            and isinstance(right, ast.Constant)
            and isinstance(right.value, int)
            and (
                (isinstance(op, ast.GtE) and right.value <= 0)
                or (isinstance(op, ast.Gt) and right.value < 0)
                or (isinstance(op, ast.IsNot) and right.value is None)
            )
        ):
            return "a length is never negative"
    if (  # isinstance(x, object)
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "isinstance"
        and len(test.args) == 2
        and isinstance(test.args[1], ast.Name)
        and test.args[1].id == "object"
    ):
        return "everything is an object"
    return None


# ------------------------------------------------------------------------------------- pytest.raises


def _raises_names(tree) -> tuple[set[str], set[str]]:
    """Names bound to the pytest module and to ``pytest.raises`` in this file."""
    mods, funcs = {"pytest"}, set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            mods |= {a.asname or a.name for a in n.names if a.name == "pytest"}
        elif isinstance(n, ast.ImportFrom) and n.module == "pytest":
            funcs |= {a.asname or a.name for a in n.names if a.name == "raises"}
    return mods, funcs


def _broad(node) -> bool:
    if isinstance(node, ast.Name):
        return node.id in BROAD
    if isinstance(node, ast.Attribute):  # builtins.Exception
        return node.attr in BROAD and isinstance(node.value, ast.Name) and node.value.id == "builtins"
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_broad(e) for e in node.elts)
    return False


# ------------------------------------------------------------------------------------------- the pass


def check(source: str, name: str = "<test>", report: Report | None = None) -> list[str]:
    """``file:line: why`` for each assertion that cannot fail, each too broad ``pytest.raises``
    and each assertion on a duration; counts what it checked in ``report``."""
    report = report if report is not None else Report()
    tree = ast.parse(source)
    clocks = _Clocks(tree)
    mods, funcs = _raises_names(tree)
    out = set()
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    asserts_seen = set()
    for fn in scopes:
        readings, durations = _timing(fn, clocks)
        flags = _constant_flags(fn) if fn is not tree else {}
        for n in ast.walk(fn):
            if not isinstance(n, ast.Assert):
                continue
            asserts_seen.add(id(n))
            v = _value(n.test, flags)
            if v is not _UNKNOWN and v:
                known = sorted(_names(n.test) & set(flags))
                why = (
                    f"asserts {', '.join(known)}, set to the same constant on every path"
                    if known
                    else "asserts a constant (or an expression of constants)"
                )
                out.add(f"{name}:{n.lineno}: assertion cannot fail: {why}")
            for part in [n.test, *(n.test.values if isinstance(n.test, ast.BoolOp) else [])]:
                why = _either_outcome(part)
                if why and part is n.test:
                    out.add(f"{name}:{n.lineno}: assertion cannot fail: {why}")
            for c in (m for m in ast.walk(n.test) if isinstance(m, ast.Compare)):
                if any(_is_duration(s, clocks, readings, durations) for s in [c.left, *c.comparators]):
                    out.add(f"{name}:{n.lineno}: assertion on wall-clock time")
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        is_raises = (isinstance(f, ast.Attribute) and f.attr == "raises" and _names(f.value) & mods) or (
            isinstance(f, ast.Name) and f.id in funcs
        )
        if not is_raises:
            continue
        report.raises += 1
        expected = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "expected_exception"), None)
        if expected is not None and _broad(expected):
            out.add(f"{name}:{n.lineno}: pytest.raises(Exception) is too broad: any error passes, a typo's included")
    report.files += 1
    report.asserts += len(asserts_seen)
    found = sorted(out, key=lambda s: (int(s.split(":")[1]), s))
    report.offences += found
    return found


def sources() -> list[Path]:
    """Every Python file under tests/ (the test modules, their helpers, the fault injectors)."""
    return sorted(HERE.rglob("*.py"))


def scan(paths=None) -> Report:
    """Check every Python file under tests/."""
    report = Report()
    for p in paths or sources():
        check(p.read_text(), str(p.relative_to(HERE)), report)
    return report


# --------------------------------------------------------------------------------------------- tests


def _rules(source: str) -> list[str]:
    return [o.split(": ", 1)[1] for o in check(source)]


def _lines(source: str) -> list[int]:
    return [int(o.split(":")[1]) for o in check(source)]


def test_durations_however_the_clock_is_reached():
    bad = (
        "import time\n"
        "import time as tm\n"
        "from time import {pc} as clock, {mono}\n"
        "tick = time.time\n"
        "def test_a():\n"
        "    t0 = time.{pc}()\n"
        "    took = time.{pc}() - t0\n"
        "    assert took < 5\n"  # 8
        "    assert time.{mono}() - t0 < 1, 'x'\n"  # 9
        "def test_b():\n"
        "    t0 = clock()\n"
        "    work()\n"
        "    t1 = clock()\n"
        "    assert t1 - t0 < 2\n"  # 14
        "    per = (t1 - t0) / 3\n"
        "    assert per <= 0.5\n"  # 16
        "def test_c():\n"
        "    start = {mono}()\n"
        "    assert {mono}() - start < 1\n"  # 19
        "    s = tm.time()\n"
        "    assert tm.time() - s < 1\n"  # 21
        "    u = tick()\n"
        "    assert 0 < tick() - u\n"  # 23
        "def test_d(t0):\n"
        "    assert changed_after(t0) and t0 < time.time()\n"  # an mtime check, not a duration
        "    deadline = time.time() + 5\n"
        "    while time.time() < deadline:\n"  # a wait, not an assertion
        "        pass\n"
        "    assert len(seen) - 1 < 5\n"
        "    since = time.time() - 1e-3\n"  # a reading shifted, not a duration
        "    assert ran_since(since) == {{1}}\n"
        "def test_e():\n"
        "    t0 = time.time()\n"
        "    took = [time.time() - t0 for _ in range(3)]\n"
        "    assert max(took) < 1\n"  # 35
        "    assert sum(took) * 1000 < 1\n"  # 36
    ).format(pc="perf_counter", mono="monotonic")  # (kept out of this file's own text)
    assert _lines(bad) == [8, 9, 14, 16, 19, 21, 23, 35, 36]
    assert set(_rules(bad)) == {"assertion on wall-clock time"}


def test_constants_and_flags_set_on_every_path():
    bad = (
        "def test_a():\n"
        "    assert 'message'\n"  # 2
        "    assert (x == 1, 'x is one')\n"  # 3
        "    assert f'{x} is one'\n"  # 4
        "    assert sum([1]) == 1 or True\n"  # 5
        "    assert True\n"  # 6
        "    assert not None\n"  # 7
        "def test_b():\n"
        "    try:\n"
        "        f()\n"
        "        ok = True\n"
        "    except ValueError:\n"
        "        ok = True\n"
        "    assert ok\n"  # 14
        "    assert ok is True\n"  # 15
        "def test_c(cond):\n"
        "    if cond:\n"
        "        seen = 'yes'\n"
        "    else:\n"
        "        seen = 'yes'\n"
        "    assert seen == 'yes'\n"  # 21
        "def test_fine(cond):\n"
        "    raised = False\n"
        "    try:\n"
        "        f()\n"
        "    except ValueError:\n"
        "        raised = True\n"
        "    assert raised\n"  # True or False: can fail
        "    if cond:\n"
        "        hit = True\n"
        "    assert hit\n"  # bound on one path only
        "    n = 0\n"
        "    for _ in g():\n"
        "        n += 1\n"
        "    assert n\n"
        "    assert False, 'unreachable'\n"  # fails: fine
        "    assert sum([1]) == 1 or False\n"
    )
    assert _lines(bad) == [2, 3, 4, 5, 6, 7, 14, 15, 21]
    assert _rules(bad)[6] == "assertion cannot fail: asserts ok, set to the same constant on every path"
    assert _rules(bad)[0] == "assertion cannot fail: asserts a constant (or an expression of constants)"


def test_either_outcome_and_broad_raises():
    bad = (
        "import pytest\n"
        "from pytest import raises as r\n"
        "def test_a(a, x, xs):\n"
        "    assert a or not a\n"  # 4
        "    assert not x.ok or x.ok\n"  # 5
        "    assert x is None or x is not None\n"  # 6
        "    assert x.n < 3 or x.n >= 3\n"  # 7
        "    assert x == x\n"  # 8
        "    assert x.ok in (True, False)\n"  # 9
        "    assert len(xs) >= 0\n"  # 10
        "    assert isinstance(x, object)\n"  # 11
        "    with pytest.raises(Exception):\n"  # 12
        "        f()\n"
        "    with pytest.raises((ValueError, BaseException), match='m'):\n"  # 14
        "        f()\n"
        "    with r(Exception):\n"  # 16
        "        f()\n"
        "def test_fine(a, b, x, xs):\n"
        "    assert a or not b\n"
        "    assert x.n < 3 or x.m >= 3\n"
        "    assert x in (1, 2)\n"
        "    assert f() == f()\n"  # two calls may differ
        "    assert len(xs) >= 1\n"
        "    with pytest.raises(ValueError):\n"
        "        f()\n"
    )
    assert _lines(bad) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16]
    assert _rules(bad)[-1].startswith("pytest.raises(Exception) is too broad")


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(HERE)))
def test_no_assertion_that_cannot_fail_and_none_on_wall_clock_time(path):
    assert check(path.read_text(), str(path.relative_to(HERE))) == []


def test_the_pass_covers_the_suite():
    """Every test module parsed, and the suite's assertions counted (the number is printed at the
    end of a pytest run that includes this file: tests/conftest.py)."""
    r = scan()
    assert r.files == len(sources()) > 30 and r.offences == []
    assert r.asserts > 1000 and r.raises > 50
