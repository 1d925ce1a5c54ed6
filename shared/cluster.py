"""The trainer workers of a multi-host job, from TensorFlow's own cluster description.

``TF_CONFIG`` (the environment variable ``tf.distribute.MultiWorkerMirroredStrategy``
reads) names every trainer worker and which one this process is::

    {"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 1}}

A ``chief`` entry, when there is one, is the first worker. stoker reads it to shard the
epoch plan (consumer/pipeline/plan.py: worker w of W trains its share of every global batch) and
to name each worker's run directory; TensorFlow reads it to connect the workers. Each
mistake is one line (ClusterError): not JSON, no worker list, an address named twice, a
task that is not in the list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import UserError

TF_CONFIG = "TF_CONFIG"


class ClusterError(UserError):
    """TF_CONFIG does not describe a cluster this process is part of; one line for the user."""


@dataclass(frozen=True)
class Cluster:
    workers: tuple[str, ...]  # every trainer worker's address, the chief first
    index: int  # this process's place in ``workers``

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        return self.index == 0


def worker_dir_name(index: int) -> str:
    """The run directory of worker ``index`` inside the job's: each worker writes its own."""
    return f"worker-{index}"


def _addresses(cluster: Mapping[str, Any], role: str) -> list[str]:
    value = cluster.get(role, [])
    if not isinstance(value, list) or not all(isinstance(a, str) and a.strip() for a in value):
        raise ClusterError(f"TF_CONFIG: cluster.{role} must be a list of \"host:port\" strings, got {value!r}")
    return [a.strip() for a in value]


def from_env(environ: Mapping[str, str]) -> Cluster | None:
    """The cluster ``TF_CONFIG`` describes; None without one (a single trainer)."""
    text = environ.get(TF_CONFIG, "").strip()
    if not text:
        return None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict):
        raise ClusterError("TF_CONFIG has no \"cluster\" object: expected {\"cluster\": {\"worker\": [...]}, "
                           "\"task\": {\"type\": \"worker\", \"index\": N}}")
    chief, workers = _addresses(spec["cluster"], "chief"), _addresses(spec["cluster"], "worker")
    if len(chief) > 1:
        raise ClusterError(f"TF_CONFIG names {len(chief)} chiefs; a cluster has at most one")
    everyone = chief + workers
    if not everyone:
        raise ClusterError("TF_CONFIG names no worker (cluster.worker is empty)")
    twice = sorted({a for a in everyone if everyone.count(a) > 1})
    if twice:
        raise ClusterError(f"TF_CONFIG names {twice[0]} twice: each trainer worker needs an address of its own")
    task = spec.get("task")
    if not isinstance(task, dict) or task.get("type") not in ("worker", "chief"):
        raise ClusterError(f"TF_CONFIG: task must be {{\"type\": \"worker\" or \"chief\", \"index\": N}}, got {task!r}")
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterError(f"TF_CONFIG: task.index must be a number, got {index!r}")
    members = chief if task["type"] == "chief" else workers
    if not 0 <= index < len(members):
        raise ClusterError(f"TF_CONFIG: task {task['type']} {index} is not in the cluster's {len(members)} "
                           f"{task['type']}(s)")
    return Cluster(tuple(everyone), index if task["type"] == "chief" else len(chief) + index)
