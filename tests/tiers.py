"""Marks that put some cases of a test in the slow tier and keep the others fast, written at the test.

The default run (`pytest`) is the fast tier; `slow` tests are left out by pyproject.toml's addopts (`pytest -m slow`
runs them, `pytest -m "not soak"` everything). A parametrized test keeps in the fast tier cases that between them
take each code path a parameter chooses; the rest of the product runs in the slow tier. Test modules import this
module by name (tests/ is on sys.path under pytest).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence

import pytest


def _case(value, argcount: int) -> tuple[str, tuple, tuple]:
    """One axis value as (its id, its arguments, its marks), the id as pytest's default would write it."""
    marks: tuple = ()
    case_id = None
    if isinstance(value, type(pytest.param(None))):
        value, case_id, marks = (value.values if argcount > 1 else value.values[0]), value.id, tuple(value.marks)
    args = tuple(value) if argcount > 1 else (value,)
    for arg in args:
        if not (arg is None or isinstance(arg, (str, int, float, bool))):
            raise TypeError(f"{arg!r} has no plain id: give its axis as {{id: value}}")
    return case_id if case_id is not None else "-".join(str(a) for a in args), args, marks


def some_fast(axes: Mapping[str, Sequence | Mapping], fast: Iterable[str], indirect: Sequence[str] = ()):
    """`pytest.mark.parametrize` over the product of `axes`, each case `slow` unless its id is in `fast`.

    `axes` maps argument names ("a" or "a, b" for tuples) to their values, or to {id: value}; values may be
    `pytest.param`s, whose marks every case with them gets. Case ids join the axes' ids in the order given,
    the order in which pytest writes stacked parametrize decorators' ids (the decorator nearest the function
    first) and fixture parameters (the fixture first): `{"layout": [...], "mask": [...]}` gives "head_major-none".
    `indirect` names fixtures among the axes that receive their value as `request.param`. A name in `fast`
    that is no case raises, so a renamed case cannot leave the fast tier unnoticed.
    """
    fast = set(fast)
    columns = []
    for names, values in axes.items():
        argcount = len(names.split(","))
        if isinstance(values, Mapping):
            columns.append([(i, tuple(v) if argcount > 1 else (v,), ()) for i, v in values.items()])
        else:
            columns.append([_case(v, argcount) for v in values])
    params = []
    for combination in itertools.product(*columns):
        case_id = "-".join(i for i, _, _ in combination)
        marks = [m for _, _, ms in combination for m in ms]
        if case_id not in fast:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(*(a for _, args, _ in combination for a in args), id=case_id, marks=marks))
    unknown = fast - {p.id for p in params}
    if unknown:
        raise ValueError(f"fast cases {sorted(unknown)} are not cases of {list(axes)}")
    return pytest.mark.parametrize(",".join(axes), params, indirect=list(indirect))


def slow_cases(*names: str):
    """Class decorator: these tests of a test class, its own or inherited, run in the slow tier.

    The mark goes on a wrapper set in this class, so a base class's test stays in the fast tier in its other
    subclasses (a mark on the base's function would reach them all)."""

    def mark(cls):
        for name in names:
            setattr(cls, name, pytest.mark.slow(_calling(getattr(cls, name))))
        return cls

    return mark


def _calling(test):
    @functools.wraps(test)
    def run(self):
        return test(self)

    return run
