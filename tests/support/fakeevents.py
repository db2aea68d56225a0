"""A stand-in CUDA event for the fine-sleep tests."""

from __future__ import annotations

import time


class _FiresAt:
    """A stand-in CUDA event that fires at a given ``perf_counter`` time."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at
