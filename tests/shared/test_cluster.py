"""TF_CONFIG read as TensorFlow reads it (the workers, a chief first, and this process's
place), torchrun's RANK and WORLD_SIZE as torch.distributed reads them, and one line for each
mistake, naming its source."""

from __future__ import annotations

import json

import pytest

from stoker.shared.cluster import TF_CONFIG, TORCHRUN, Cluster, ClusterError, from_env


def env(spec) -> dict[str, str]:
    return {"TF_CONFIG": spec if isinstance(spec, str) else json.dumps(spec)}


def test_no_tf_config_is_a_single_trainer() -> None:
    assert from_env({}) is None and from_env({"TF_CONFIG": "  "}) is None


def test_workers_and_this_ones_place_with_the_chief_first() -> None:
    two = from_env(env({"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}))
    assert two == Cluster(2, 1, TF_CONFIG, ("h0:1", "h1:1")) and not two.is_chief
    chief = {"cluster": {"chief": ["c:1"], "worker": ["h0:1", "h1:1"]}}
    assert from_env(env({**chief, "task": {"type": "chief", "index": 0}})) == Cluster(3, 0, TF_CONFIG,
                                                                                      ("c:1", "h0:1", "h1:1"))
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


TORCHRUN_RANK_1 = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}


def test_torchrun_ranks_are_the_workers() -> None:
    """Each rank is a trainer worker: its place is RANK, and LOCAL_RANK says which GPU of its host."""
    rank = from_env(TORCHRUN_RANK_1)
    assert rank == Cluster(4, 1, TORCHRUN, local_rank=1, local_size=2) and not rank.is_chief
    assert from_env({"RANK": "0", "WORLD_SIZE": "1"}) == Cluster(1, 0, TORCHRUN)
    assert from_env({"LOCAL_RANK": "0"}) is None  # another launcher's variable alone describes no job


@pytest.mark.parametrize(("environ", "says"), [
    ({**TORCHRUN_RANK_1, "TF_CONFIG": '{"cluster": {"worker": ["h:1"]}}'},
     "both TF_CONFIG and torchrun's RANK, WORLD_SIZE are set: a job has one launcher"),
    ({"RANK": "0"}, "torchrun: RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "torchrun: WORLD_SIZE is set but RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "torchrun: RANK 2 is not in the job's WORLD_SIZE 2 ranks"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "torchrun: RANK='one' is not a number >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "torchrun: WORLD_SIZE='0' is not a number >= 1"),
    ({**TORCHRUN_RANK_1, "LOCAL_RANK": "2"}, "torchrun: LOCAL_RANK 2 is not in this host's LOCAL_WORLD_SIZE 2"),
])
def test_a_broken_torchrun_environment_is_one_line(environ, says) -> None:
    with pytest.raises(ClusterError) as info:
        from_env(environ)
    assert says in str(info.value) and "\n" not in str(info.value)
