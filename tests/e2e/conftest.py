"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sfharness import assert_none_left


@pytest.fixture
def no_worker_outlives_its_launcher(tmp_path: Path) -> Iterator[None]:
    """The conftest leak check sees only direct children: a launcher's workers are
    grandchildren, found by the test's tmp path in their command lines."""
    yield
    assert_none_left(str(tmp_path))
