"""Fixtures of the benchmark tests: no benchmark may leave a process behind."""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_tracker

import psutil
import pytest


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    for child in multiprocessing.active_children():  # reaps finished ones; lists live ones
        child.terminate()
        child.join(5)
    # multiprocessing's resource tracker is one shared helper that lives as long as pytest
    tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    leftover = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.pid != tracker and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    for p in leftover:
        p.kill()
    assert not leftover, f"benchmark left processes behind: {leftover}"
