"""Session set-up shared by every test directory.

Model replicas on a host without GPUs are logical CPU devices, and TensorFlow can split
the CPU only before it sets up its devices. A test that trains replicas in this process
asks for the ``replica_devices`` fixture; when the session holds one, the CPU is split
into ``REPLICA_DEVICES`` logical devices right after collection, before any test runs
(a run without such a test never imports TensorFlow here). Tests of one device are
unaffected: they use the first.
"""

from __future__ import annotations

import pytest

REPLICA_DEVICES = 2  # the fewest that show replicas doing different work


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("replica_devices" in getattr(item, "fixturenames", ()) for item in items):
        from stoker.shared.tfsetup import split_cpu

        split_cpu(REPLICA_DEVICES)


@pytest.fixture
def replica_devices() -> list[str]:
    """The logical CPU devices of this test process, one per model replica."""
    from stoker.shared.tfsetup import split_cpu

    return split_cpu(REPLICA_DEVICES)
