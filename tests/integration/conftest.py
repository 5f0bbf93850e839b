"""Every integration test starts Ray, vLLM or a whole run: all of them are ``slow``, so
``pytest -m "not slow"`` is the unit tests (the fast loop)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
