"""One launch shared by several tests (a module fixture's helper)."""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def once_per_key(launch: Callable[[K], V]) -> Callable[[K], V]:
    """``get(key)``: ``launch(key)``, called at the first ``get`` of each key only. An error is kept like a
    result: every later ``get`` of that key raises it again (one launch per key, failed or not)."""
    done: dict[K, V | BaseException] = {}

    def get(key: K) -> V:
        if key not in done:
            try:
                done[key] = launch(key)
            except Exception as err:  # noqa: BLE001 - re-raised below, for this get and every later one
                done[key] = err
        if isinstance(done[key], BaseException):
            raise done[key]
        return done[key]

    return get


def run_once(launch: Callable[[], dict[Hashable, Any]]) -> Callable[[Hashable], Any]:
    """``get(key)``: `launch`'s result for `key`, `launch` called at the first ``get`` only. If it raised,
    every later ``get`` raises that error again instead of launching a second time (a failed or hung
    launch fails each test that shares it, once)."""
    job = once_per_key(lambda _: launch())
    return lambda key: job(None)[key]
