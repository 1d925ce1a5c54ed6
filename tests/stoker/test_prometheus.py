"""A real Prometheus server scrapes a running trainer's ``--metrics-port`` and answers queries
for stoker's figures through its HTTP API (Debian's ``prometheus`` package, installed here
when missing; skipped, saying why, where it cannot be installed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.procs import RunProcess, free_port
from tests.test_run import NUMPY_FEATURES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Prometheus scrapes this often (its floor is far below; one second keeps the test short).
SCRAPE_S = 1
# The trainer's progress lines (every trainer.log_every_steps) pace the queries.
PROGRESS = re.compile(r"step \d+")
# Every wait for an answer ends by this deadline; a healthy scrape answers within a few seconds.
ANSWER_DEADLINE_S = 60.0


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the prometheus server is not installed and this user cannot install it (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"],
                          capture_output=True, text=True, timeout=180, env=env)
    if done.returncode != 0 or not shutil.which("prometheus"):
        pytest.skip(f"the prometheus server could not be installed: {done.stderr.strip()[-300:]}")
    return shutil.which("prometheus") or "prometheus"


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success"
    return body["data"]["result"]


def test_prometheus_scrapes_queue_depth_and_wait_share(tmp_path: Path) -> None:
    binary = prometheus_binary()
    metrics_port, api_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {SCRAPE_S}s\n"
        f"scrape_configs:\n  - job_name: stoker\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    server = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{api_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with RunProcess("--model", "synthetic:40", "--steps", "2000", "--producers", "1", "--metrics-port",
                        str(metrics_port), "--run-dir", str(tmp_path / "run"), *NUMPY_FEATURES) as run:
            run.wait_for_line(r"step \d+", timeout=60)
            seen: dict[str, list[dict]] = {}
            deadline = time.monotonic() + ANSWER_DEADLINE_S
            while time.monotonic() < deadline and len(seen) < 3:
                try:
                    for name in ("stoker_queue_depth", "stoker_data_wait_fraction", "stoker_steps_total"):
                        result = query(api_port, name)
                        if result:
                            seen[name] = result
                except OSError:  # the server is still starting
                    pass
                if len(seen) < 3:  # ask again after the run's next progress line (about a second)
                    progress = sum(1 for line in run.lines if PROGRESS.search(line))
                    run.wait_for_line(PROGRESS.pattern, timeout=30, count=progress + 1)
            assert set(seen) == {"stoker_queue_depth", "stoker_data_wait_fraction", "stoker_steps_total"}, seen
            depth = float(seen["stoker_queue_depth"][0]["value"][1])
            wait = float(seen["stoker_data_wait_fraction"][0]["value"][1])
            assert 0 <= depth <= 3 and 0 <= wait <= 1 and float(seen["stoker_steps_total"][0]["value"][1]) > 0
            assert seen["stoker_queue_depth"][0]["metric"]["job"] == "stoker"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
