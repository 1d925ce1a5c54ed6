"""Fixtures of the application layer's tests."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest


@pytest.fixture
def kept_logging() -> Iterator[None]:
    """The command line sets up the root logger for its run: this process's is put back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
