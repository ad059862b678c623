"""Handles of collectives: what a reducer or a sharded collective returns, to `wait()` on."""

from __future__ import annotations

from typing import Protocol

__all__ = ["Waitable", "CompletedWork"]


class Waitable(Protocol):
    def wait(self) -> object: ...


class CompletedWork:
    """The handle of work that finished when it was started (a world of one, a synchronous
    collective): `wait()` returns at once. The one such type in the package: reducers, the sharded
    collectives (`comm.sharded`) and the strategies all return it where nothing is left in flight."""

    def wait(self) -> bool:
        return True
