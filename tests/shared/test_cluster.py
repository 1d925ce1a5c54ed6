"""TF_CONFIG read as TensorFlow reads it: the workers (a chief first), this process's place,
and one line for each mistake."""

from __future__ import annotations

import json

import pytest

from stoker.shared.cluster import Cluster, ClusterError, from_env


def env(spec) -> dict[str, str]:
    return {"TF_CONFIG": spec if isinstance(spec, str) else json.dumps(spec)}


def test_no_tf_config_is_a_single_trainer() -> None:
    assert from_env({}) is None and from_env({"TF_CONFIG": "  "}) is None


def test_workers_and_this_ones_place_with_the_chief_first() -> None:
    two = from_env(env({"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}))
    assert two == Cluster(("h0:1", "h1:1"), 1) and two.size == 2 and not two.is_chief
    chief = {"cluster": {"chief": ["c:1"], "worker": ["h0:1", "h1:1"]}}
    assert from_env(env({**chief, "task": {"type": "chief", "index": 0}})) == Cluster(("c:1", "h0:1", "h1:1"), 0)
    assert from_env(env({**chief, "task": {"type": "worker", "index": 1}})).index == 2


@pytest.mark.parametrize(("spec", "says"), [
    ("{cluster: nope", "TF_CONFIG is not valid JSON (Expecting property name enclosed in double quotes at "
                       "character 1)"),
    ({"task": {"type": "worker", "index": 0}}, "TF_CONFIG has no \"cluster\" object"),
    ({"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 0}}, "TF_CONFIG names h:1 twice"),
    ({"cluster": {"worker": "h:1"}, "task": {"type": "worker", "index": 0}}, "cluster.worker must be a list"),
    ({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}, "TF_CONFIG names no worker"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}}, "task worker 1 is not in the "
                                                                               "cluster's 1 worker(s)"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "ps", "index": 0}}, "task must be"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}}, "task.index must be a number"),
])
def test_a_broken_tf_config_is_one_line(spec, says) -> None:
    with pytest.raises(ClusterError) as info:
        from_env(env(spec))
    assert says in str(info.value) and "\n" not in str(info.value)
