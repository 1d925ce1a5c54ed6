"""stoker/hostpool.py: which ranks share a pool, and local rank 0 taking only the endpoints that
live ranks of this attempt published."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from stoker.hostpool import HostPool, PoolError
from stoker.shared.runfiles import LISTENING
from stoker.shared.cluster import Cluster, TF_CONFIG, TORCHRUN, worker_dir_name


def torchrun(rank: int, local_rank: int, local_size: int, size: int = 4) -> Cluster:
    return Cluster(size, rank, TORCHRUN, local_rank=local_rank, local_size=local_size)


def pool_of(job: Path, rank: int, local_rank: int, local_size: int = 2) -> HostPool:
    run_dir = job / worker_dir_name(rank)
    run_dir.mkdir(parents=True, exist_ok=True)
    pool = HostPool.of(torchrun(rank, local_rank, local_size), "host", run_dir)
    assert pool is not None
    return pool


def test_a_pool_only_for_torchrun_ranks_sharing_a_host_when_asked(tmp_path: Path) -> None:
    run_dir = tmp_path / "job" / "worker-3"
    assert HostPool.of(torchrun(3, 1, 2), "rank", run_dir) is None  # each rank its own producers
    assert HostPool.of(torchrun(3, 0, 1), "host", run_dir) is None  # alone on its host
    assert HostPool.of(Cluster(4, 3, TF_CONFIG), "host", run_dir) is None  # TensorFlow's workers: one per host
    assert HostPool.of(None, "host", run_dir) is None
    pool = HostPool.of(torchrun(3, 1, 2), "host", run_dir)
    assert pool is not None and not pool.starts and list(pool.ranks()) == [2, 3]
    assert pool.file(2) == tmp_path / "job" / "worker-2" / LISTENING
    first = HostPool.of(torchrun(2, 0, 2), "host", tmp_path / "job" / "worker-2")
    assert first is not None and first.starts and list(first.ranks()) == [2, 3]


def test_local_rank_0_gathers_every_local_ranks_endpoint_in_rank_order(tmp_path: Path) -> None:
    first, second = pool_of(tmp_path, 2, 0), pool_of(tmp_path, 3, 1)
    second.publish("tcp://127.0.0.1:5003")  # the ranks bind in any order
    first.publish("tcp://127.0.0.1:5002")
    assert first.endpoints(wait_s=30) == ["tcp://127.0.0.1:5002", "tcp://127.0.0.1:5003"]


def test_an_endpoint_is_taken_once_its_rank_publishes_it(tmp_path: Path) -> None:
    first, second = pool_of(tmp_path, 0, 0), pool_of(tmp_path, 1, 1)
    first.publish("tcp://127.0.0.1:5000")
    found: list[str] = []
    waiting = threading.Thread(target=lambda: found.extend(first.endpoints(wait_s=60)))
    waiting.start()
    second.publish("tcp://127.0.0.1:5001")
    waiting.join(60)
    assert found == ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]


def test_a_file_of_a_process_gone_or_of_another_start_is_never_taken(tmp_path: Path) -> None:
    """What an earlier attempt left: its rank's pid is gone, or the pid now names another process."""
    first = pool_of(tmp_path, 0, 0)
    first.publish("tcp://127.0.0.1:5000")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    stale = first.file(1)
    stale.parent.mkdir(parents=True, exist_ok=True)
    for pid, started in ((gone.pid, 1.0), (psutil.Process().pid, psutil.Process().create_time() - 5)):
        stale.write_text(json.dumps({"endpoint": "tcp://127.0.0.1:4999", "pid": pid, "started": started}))
        with pytest.raises(PoolError) as caught:
            first.endpoints(wait_s=0.2)
        assert str(caught.value) == (
            f"pipeline.producers_per host: rank 1 of this host did not bind its stoker.Feed within 0.2 s (no "
            f"{LISTENING} of a live process in {stale.parent}): every rank makes its feed, with the same run "
            f"directory and pipeline.producers_per")
