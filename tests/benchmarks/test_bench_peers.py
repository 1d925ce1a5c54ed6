"""benchmarks/peers.py: every peer's pipeline makes the feed's arrays and takes every clip
once (on tiny data, in the check child the bench runs before timing); a timed run of each
way counts every clip once per epoch; the figures' structure. No timings judged."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.benchmarks import gpu, peers
from stoker.benchmarks.common import BenchError
from stoker.benchmarks.corpus import leases_of, make_clips
from tests.benchmarks.checks import assert_ratio

SIZE = {"data": "", "batch_size": 8, "size": {"dim": gpu.CPU_DIM, "layers": 1, "heads": 2, "decoder_layers": 1},
        "hold_ops": 0, "name": "small"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("peers-clips")
    make_clips(root, 16)
    return root


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_peer_makes_the_feeds_arrays_and_takes_each_clip_once(clips: Path, tmp_path: Path) -> None:
    ways = [w for w in peers.PEER_WAYS if w not in peers.missing(peers.PEER_WAYS)]
    assert "dataloader" in ways  # torch is always there
    spec = {**SIZE, "data": str(clips), "kind": "check", "epochs": 1, "workers": 1, "ways": ways,
            "work": str(tmp_path / "check")}
    result = peers.run_child(spec, tmp_path / "check.log")
    assert result["batches"] == 2 and list(result["ways"]) == ways  # 16 clips, batches of 8
    for way, v in result["ways"].items():
        assert v["equal"] and v["batches"] == 2, way
        assert v["clips"] == 16 and v["epochs"] == 1 and v["steps"] == 2, way
    assert result["data_cpu_ms_per_batch"]["n"] == 2 and result["tree_cpu_s"] > 0 and result["peak_pss_mb"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("way", ["feed-cache", "spdl-processes"])  # the check covers every peer at W = 1
def test_a_timed_run_counts_every_clip_once_per_epoch(way: str, clips: Path, tmp_path: Path) -> None:
    if way in peers.missing([way]):
        pytest.skip(peers.missing([way])[way])
    spec = {**SIZE, "data": str(clips), "kind": way, "epochs": 2, "workers": 2, "work": str(tmp_path / way)}
    raw = peers.run_child(spec, tmp_path / f"{way}.log")
    assert raw["counted"] == {"clips": 16, "epochs": 2, "steps": 4}
    s = peers.summarize(raw, warmup_steps=1)
    assert s["samples"] == 32 and s["steps"] == 4 and s["samples_per_s"] > 0 and s["first_batch_s"] > 0
    assert s["cpu_s"] > 0 and s["peak_pss_mb"] > 0 and s["step_cpu_ms"] > 0


def test_a_clip_taken_twice_or_missed_fails_the_count(clips: Path) -> None:
    _, _, planned, tokens = gpu.planned_batches(str(clips), 8, 2)
    leases = leases_of(planned, tokens)
    everyone = {i for lease in leases for i in lease.ids}
    assert peers.counted_once(leases, [lease.ids for lease in leases], everyone) == {"clips": 16, "epochs": 2,
                                                                                     "steps": 4}
    with pytest.raises(BenchError, match="taken 1 times in 2 epochs"):
        peers.counted_once(leases, [lease.ids for lease in leases[:-1]], everyone)
    with pytest.raises(BenchError, match="taken 3 times"):
        peers.counted_once(leases, [lease.ids for lease in [*leases, leases[0]]], everyone)


def _run(sps: float, first: float = 1.0, shapes: dict[str, float] | None = None) -> dict:
    return {"samples_per_s": sps, "wait_share": 0.01, "first_batch_s": first, "cpu_s": 10.0, "peak_pss_mb": 500.0,
            "step_cpu_ms": 40.0, "samples": 64, "steps": 4, "counted": None,
            "step_ms": {shape: {"median": ms, "n": 3} for shape, ms in (shapes or {"8x40x400": 40.0}).items()}}


def test_figures_the_limit_the_step_against_replay_and_the_lead() -> None:
    head = {"cores": 2, "same_work": {"data_cpu_ms_per_batch": {"median": 60.0}}}
    samples = {"replay": {"0": [_run(400.0, None, {"8x40x400": 40.0})]},
               "feed": {"1": [_run(230.0, 2.0, {"8x40x400": 42.0}), _run(240.0, 2.5, {"8x40x400": 44.0})]},
               "grain": {"1": [_run(200.0, 3.0), _run(210.0, 3.5)]},
               "spdl-threads": {"1": [_run(190.0, 0.8), _run(250.0, 0.9)]}}
    out = peers.figures(head, samples)
    lim = out["limit"]
    assert lim["cores_samples_per_s"] == pytest.approx(2 / 0.1 * 16) and lim["step_samples_per_s"] == 400.0
    assert lim["samples_per_s"] == pytest.approx(320.0)
    feed = out["ways"]["feed"]["1"]
    assert feed["samples_per_s"]["median"] == 235.0 and feed["of_limit"] == pytest.approx(235.0 / 320.0)
    assert feed["step_vs_replay"] == {"8x40x400": pytest.approx(43.0 / 40.0)}
    lead, of_limit, first = out["targets"]
    assert lead["what"].startswith("W=1: feed / best peer (spdl-threads)")  # the best median, 220 against 205
    assert_ratio(lead["ratio"])
    assert lead["ratio"]["numerator"] == 235.0 and lead["ratio"]["denominator"] == 220.0
    assert not lead["apart"] and not lead["met"]  # 230 is under spdl's 250
    assert not of_limit["met"] and first["value"] == pytest.approx(2.25 - 0.85) and not first["met"]
    text = peers.render({**head, **out, "step": "s", "skipped": {"grain": "grain skipped: ..."},
                         "same_work": {**head["same_work"], "ways": {"grain": {}}, "batches": 2}})
    assert "grain skipped" in text and "320.0 samples/s" in text and "NOT met" in text


def test_a_missing_package_is_skipped_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(peers.PACKAGES, "grain", "no_such_package_here")
    assert peers.missing(["dataloader", "grain"]) == {
        "grain": "grain skipped: the package 'no_such_package_here' is not installed (pip install '.[test]')"}


def test_each_repetition_runs_every_way_once_per_w_in_a_rotated_order() -> None:
    plan = peers.PeersPlan(workers=(1, 2))
    ways = ["replay", "feed", "grain"]
    first, second = peers.schedule(plan, ways, 0), peers.schedule(plan, ways, 1)
    assert sorted(first) == sorted(second) == sorted([("replay", 0), ("feed", 1), ("grain", 1), ("feed", 2),
                                                      ("grain", 2)])
    assert first[0] == ("replay", 0) and second[0] == ("feed", 1) and second[-1] == ("replay", 0)
