"""The registry of named faults: ``Fault``, ``FAULTS``, turning faults on and off, and the patches they are made of.

``lessons_lib.faults`` re-exports all of it (read its docstring first); the area modules register their faults here.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["ENV", "FAULTS", "Fault", "active", "apply_from_env", "fault", "injected", "swap_attr", "swap_function",
           "swap_item"]

ENV = "LESSONS_FAULTS"
Undo = Callable[[], None]


@dataclass(frozen=True)
class Fault:
    """One named bug: ``name`` (snake_case), ``what`` (the bug in words), ``area`` (the engine part it
    breaks), ``install()`` patches the engine in this process and returns the undo."""

    name: str
    what: str
    install: Callable[[], Undo]
    area: str = ""


FAULTS: dict[str, Fault] = {}
_ACTIVE: dict[str, Undo] = {}   # faults on in this process, in the order they were installed


def fault(name: str, what: str, area: str) -> Callable[[Callable[[], list[Undo]]], Callable[[], list[Undo]]]:
    """Register ``patches`` (returns the undo of each patch it made) as the fault ``name``."""
    def deco(patches: Callable[[], list[Undo]]) -> Callable[[], list[Undo]]:
        if name in FAULTS:
            raise ValueError(f"fault {name!r} is registered twice")

        def install() -> Undo:
            undos = patches()
            return lambda: [undo() for undo in reversed(undos)]
        FAULTS[name] = Fault(name, what, install, area)
        return patches
    return deco


def _check(names) -> list[str]:
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"a fault name must be a str, got {name!r}")
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known faults: {', '.join(sorted(FAULTS))}")
    return names


def active() -> tuple[str, ...]:
    """The names of the faults on in this process, in the order they were turned on."""
    return tuple(_ACTIVE)


@contextlib.contextmanager
def injected(*names: str) -> Iterator[tuple[str, ...]]:
    """Turn the faults ``names`` on inside the block, in this process and in TP workers spawned inside it.

    Yields the faults on in the block. A name already on is left as it is; the others are undone on
    exit, and ``LESSONS_FAULTS`` is set back to what it was."""
    new = [n for n in dict.fromkeys(_check(names)) if n not in _ACTIVE]
    before = os.environ.get(ENV)
    turned_on = []
    try:
        for name in new:
            _ACTIVE[name] = FAULTS[name].install()
            turned_on.append(name)
        os.environ[ENV] = ",".join(_ACTIVE)
        yield active()
    finally:
        for name in reversed(turned_on):
            _ACTIVE.pop(name)()
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def apply_from_env() -> tuple[str, ...]:
    """Turn on, for the rest of this process, the faults named in ``LESSONS_FAULTS`` that are not on yet
    (a TP worker at start-up, a notebook kernel under test); returns the names turned on."""
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    new = [n for n in dict.fromkeys(_check(names)) if n not in _ACTIVE]
    for name in new:
        _ACTIVE[name] = FAULTS[name].install()
    return tuple(new)


# ---- the patches a fault is made of: each returns its undo ---------------------------------------------

def swap_attr(owner, name: str, value) -> Undo:
    """``owner.name = value`` (a class's method, a module's constant); the undo puts the old value back."""
    had, old = name in vars(owner), vars(owner).get(name)   # a class's own entry (an inherited one is deleted again)
    setattr(owner, name, value)
    return lambda: setattr(owner, name, old) if had else delattr(owner, name)


def swap_item(mapping: dict, key, value) -> Undo:
    """``mapping[key] = value`` (a backend table's entry); the undo puts the old entry back."""
    old = mapping[key]
    mapping[key] = value
    return lambda: mapping.__setitem__(key, old)


def _namespaces() -> list[dict]:
    """The globals where an engine function may be looked up: every loaded ``lessons_lib`` module, and ``__main__``
    (a notebook that did ``from lessons_lib.core.batch import pack``)."""
    return [vars(m) for n, m in list(sys.modules.items())
            if m is not None and (n == "lessons_lib" or n.startswith("lessons_lib.") or n == "__main__")]


def swap_function(module, name: str, value) -> Undo:
    """Replace the function ``module.name`` wherever it is looked up: in ``module`` and in every loaded
    ``lessons_lib`` module (and ``__main__``) that imported it by name. The undo puts the real one back
    everywhere the replacement is found then (modules imported while the fault was on included)."""
    real = getattr(module, name)
    for space in _namespaces():
        for key, v in list(space.items()):
            if v is real:
                space[key] = value

    def undo() -> None:
        for space in _namespaces():
            for key, v in list(space.items()):
                if v is value:
                    space[key] = real
    return undo
