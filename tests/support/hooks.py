"""Fault injection at the receive store's landing, shared by the tests that need an event
(a cancel, a deadline) in the very loop pass in which a tensor lands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from aiokv.engine.store import ReceiveStore


def after_landing(
    monkeypatch: pytest.MonkeyPatch, then: Callable[[ReceiveStore, str], None]
) -> Callable[[], None]:
    """Call ``then(store, tensor_id)`` right after each tensor lands in a receive store,
    whichever way it lands: ``land`` (a reserved transfer's data) or ``try_land`` (a PUT,
    reserved and landed in one step). Returns a function that removes the hook."""
    land, try_land = ReceiveStore.land, ReceiveStore.try_land

    def hooked_land(self: ReceiveStore, peer: Any, tid: str, value: Any) -> None:
        land(self, peer, tid, value)
        then(self, tid)

    def hooked_try_land(
        self: ReceiveStore, peer: Any, items: list[tuple[str, int, Any]], **kw: Any
    ) -> bool:
        ok = try_land(self, peer, items, **kw)
        if ok:
            for tid, _, _ in items:
                then(self, tid)
        return ok

    def restore() -> None:
        monkeypatch.setattr(ReceiveStore, "land", land)
        monkeypatch.setattr(ReceiveStore, "try_land", try_land)

    monkeypatch.setattr(ReceiveStore, "land", hooked_land)
    monkeypatch.setattr(ReceiveStore, "try_land", hooked_try_land)
    return restore
