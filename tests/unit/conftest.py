"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sfharness import started_probe
from steadfast.progress.probe import Probe


@pytest.fixture
def probe() -> Iterator[Probe]:
    """A progress probe started in this process, as a worker has it (sfharness)."""
    with started_probe() as p:
        yield p
