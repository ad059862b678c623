"""One launch shared by several tests (a module fixture's helper)."""

from __future__ import annotations

from typing import Any, Callable, Hashable


def run_once(launch: Callable[[], dict[Hashable, Any]]) -> Callable[[Hashable], Any]:
    """``get(key)``: `launch`'s result for `key`, `launch` called at the first ``get`` only. If it raised,
    every later ``get`` raises that error again instead of launching a second time (a failed or hung
    launch fails each test that shares it, once)."""
    results: dict[Hashable, Any] = {}
    failed: list[BaseException] = []

    def get(key: Hashable) -> Any:
        if failed:
            raise failed[0]
        if not results:
            try:
                results.update(launch())
            except Exception as err:
                failed.append(err)
                raise
        return results[key]

    return get
