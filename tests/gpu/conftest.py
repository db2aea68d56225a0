"""Skip GPU tests where the GPUs are missing: ``gpu`` needs one, ``multi_gpu`` two."""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():  # CPU torch without numpy warns at import (filterwarnings=error)
    warnings.simplefilter("ignore", UserWarning)
    import torch


def _gpu_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = _gpu_count()
    for item in items:
        if item.get_closest_marker("multi_gpu") is not None and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {n}"))
        elif item.get_closest_marker("gpu") is not None and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
