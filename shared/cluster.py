"""The trainer workers of a multi-host job, from the launcher's own description of it.

Two launchers describe a job, and stoker reads either (never both at once):

- ``TF_CONFIG`` (what ``tf.distribute.MultiWorkerMirroredStrategy`` reads) names every
  trainer worker and which one this process is::

      {"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 1}}

  A ``chief`` entry, when there is one, is the first worker.
- ``torchrun`` (torch.distributed's ``env://`` variables) gives each rank ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``: every rank is a trainer worker.

stoker reads the job to shard the epoch plan (consumer/plan.py: worker w of W
trains its share of every global batch) and to name each worker's run directory; the
framework reads it to connect the workers. Each mistake is one line (ClusterError) naming
its source: not JSON, no worker list, an address named twice, a task or rank that is not in
the job, both launchers' variables set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import UserError

TF_CONFIG = "TF_CONFIG"
TORCHRUN = "torchrun"  # a source: torch.distributed's env:// variables (torchrun sets them all)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class ClusterError(UserError):
    """The environment does not describe a job this process is part of; one line for the user."""


@dataclass(frozen=True)
class Cluster:
    size: int  # trainer workers in the job (TF_CONFIG's workers, torchrun's WORLD_SIZE)
    index: int  # this process's place among them (the chief first; torchrun's RANK)
    source: str = TF_CONFIG  # what described the job: TF_CONFIG or TORCHRUN
    addresses: tuple[str, ...] = ()  # every worker's address, where the source names them (TF_CONFIG)
    local_rank: int | None = None  # torchrun: this rank's place among its host's ranks (LOCAL_RANK)
    local_size: int | None = None  # torchrun: the ranks on this host (LOCAL_WORLD_SIZE)

    @property
    def is_chief(self) -> bool:
        return self.index == 0


def worker_dir_name(index: int) -> str:
    """The run directory of worker ``index`` inside the job's: each worker writes its own."""
    return f"worker-{index}"


def from_env(environ: Mapping[str, str]) -> Cluster | None:
    """The job ``TF_CONFIG`` or torchrun's variables describe; None without either (a single
    trainer); ClusterError when both are set."""
    tf_config = environ.get(TF_CONFIG, "").strip()
    torchrun = [name for name in TORCHRUN_VARIABLES[:2] if environ.get(name, "").strip()]  # LOCAL_* alone: no job
    if tf_config and torchrun:
        raise ClusterError(f"both TF_CONFIG and torchrun's {', '.join(torchrun)} are set: a job has one launcher; "
                           f"unset TF_CONFIG under torchrun (or the torchrun variables under TensorFlow's workers)")
    if tf_config:
        return _from_tf_config(tf_config)
    if torchrun:
        return _from_torchrun(environ)
    return None


def _number(environ: Mapping[str, str], name: str, lowest: int) -> int | None:
    """torchrun's variable ``name`` as a number >= ``lowest`` (None: not set)."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < lowest:
        raise ClusterError(f"torchrun: {name}={text!r} is not a number >= {lowest}")
    return int(text)


def _from_torchrun(environ: Mapping[str, str]) -> Cluster:
    rank, size = _number(environ, "RANK", 0), _number(environ, "WORLD_SIZE", 1)
    if rank is None or size is None:
        missing, given = ("RANK", "WORLD_SIZE") if rank is None else ("WORLD_SIZE", "RANK")
        raise ClusterError(f"torchrun: {given} is set but {missing} is not: start each rank with torchrun (or set "
                           f"RANK and WORLD_SIZE both)")
    if rank >= size:
        raise ClusterError(f"torchrun: RANK {rank} is not in the job's WORLD_SIZE {size} ranks")
    local_rank, local_size = _number(environ, "LOCAL_RANK", 0), _number(environ, "LOCAL_WORLD_SIZE", 1)
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ClusterError(f"torchrun: LOCAL_RANK {local_rank} is not in this host's LOCAL_WORLD_SIZE {local_size} "
                           f"ranks")
    return Cluster(size, rank, TORCHRUN, local_rank=local_rank, local_size=local_size)


def _addresses(cluster: Mapping[str, Any], role: str) -> list[str]:
    value = cluster.get(role, [])
    if not isinstance(value, list) or not all(isinstance(a, str) and a.strip() for a in value):
        raise ClusterError(f"TF_CONFIG: cluster.{role} must be a list of \"host:port\" strings, got {value!r}")
    return [a.strip() for a in value]


def _from_tf_config(text: str) -> Cluster:
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
    return Cluster(len(everyone), index if task["type"] == "chief" else len(chief) + index, TF_CONFIG,
                   tuple(everyone))
