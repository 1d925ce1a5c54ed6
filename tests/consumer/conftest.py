"""Fixtures of the consumer tests."""

from __future__ import annotations

import pytest

from tests.consumer.harness import Harness


@pytest.fixture
def harness():
    made = []

    def make(**kwargs) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
