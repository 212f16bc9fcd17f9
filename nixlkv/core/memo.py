"""A cached property without a lock, and a bounded memo, for the immutable facts a handshake
parses and plans."""

from __future__ import annotations

from typing import Any


class cached_property:  # noqa: N801 - functools.cached_property without Python 3.11's lock
    """A value computed on first access and kept in the instance's ``__dict__`` (later accesses
    never reach this descriptor). Python 3.11's ``functools.cached_property`` takes a class-wide
    lock on every first access; a handshake makes a few tens of such first accesses on the objects
    it parses and plans, and the values here are pure functions of immutable objects, so two
    threads computing one at once would store equal values (Python 3.12 dropped the lock too)."""

    def __init__(self, func: Any) -> None:
        self.func = func
        self.attrname: str | None = None
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.attrname = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.attrname] = self.func(instance)
        return value


def remember(memo: dict[Any, Any], key: Any, value: Any, bound: int) -> None:
    """``memo[key] = value``, emptying the memo first where it holds ``bound`` entries: bounded,
    and ``clear()`` is one atomic step for the threads that read it."""
    if len(memo) >= bound:
        memo.clear()
    memo[key] = value
