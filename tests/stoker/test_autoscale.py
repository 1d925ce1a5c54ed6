"""The auto-scaler's decisions on given evidence: direction, streaks, hysteresis."""

from __future__ import annotations

import json

from stoker.autoscale import ADD_STREAK, REMOVE_STREAK, AutoScaler, Evidence, LiveWindow


def ev(wait: float, depth: float = 0.0, blocked: float | None = 0.0, cpu: float = 0.3, delivering: int = 9,
       steps: int = 20) -> Evidence:
    return Evidence(wait, depth, blocked, steps, cpu, delivering)


def test_adds_only_after_a_streak_of_starving_windows():
    scaler = AutoScaler(max_producers=4, capacity=3)
    decisions = [scaler.decide(1, ev(0.5)) for _ in range(ADD_STREAK)]
    assert decisions == [0] * (ADD_STREAK - 1) + [1]


def test_no_add_without_a_free_core_or_above_maximum():
    scaler = AutoScaler(max_producers=2, capacity=3)
    assert [scaler.decide(1, ev(0.5, cpu=0.99)) for _ in range(4)] == [0, 0, 0, 0]
    assert [scaler.decide(2, ev(0.5)) for _ in range(4)] == [0, 0, 0, 0]
    assert "maximum" in scaler.decisions[-1]["reason"]


def test_removes_idle_producers_but_never_back_into_starvation():
    scaler = AutoScaler(max_producers=8, capacity=3)
    for _ in range(ADD_STREAK):
        scaler.decide(2, ev(0.3))  # 2 starved
    idle = ev(0.0, depth=2.9, blocked=0.9)
    assert [scaler.decide(4, idle) for _ in range(REMOVE_STREAK)][-1] == -1  # 4 -> 3 is above 2
    assert all(scaler.decide(3, idle) == 0 for _ in range(3 * REMOVE_STREAK))  # 3 -> 2 would starve again


def test_waits_for_new_producers_and_small_windows():
    scaler = AutoScaler(max_producers=8, capacity=3)
    assert all(scaler.decide(3, ev(0.5, delivering=2)) == 0 for _ in range(5))
    assert all(scaler.decide(3, ev(0.5, steps=2)) == 0 for _ in range(5))


def test_alternating_evidence_does_not_oscillate():
    scaler = AutoScaler(max_producers=8, capacity=3)
    changes = [scaler.decide(2, ev(0.2) if i % 2 else ev(0.0, 2.9, 0.9)) for i in range(20)]
    assert changes == [0] * 20


def test_live_window_measures_blocked_share_between_readings(tmp_path):
    def write(batches: int, prep: float, credit: float, wait: float = 0.0) -> None:
        live = {"window": {"wait_frac": wait, "queue_depth_mean": 3.0, "steps": 10},
                "producers": [{"id": "p0", "status": "alive", "batches": batches,
                               "prep_ms_mean": prep, "credit_wait_ms_mean": credit}]}
        (tmp_path / "live.json").write_text(json.dumps(live))

    window = LiveWindow(tmp_path)
    write(10, 100.0, 0.0)
    first = window.read(0.2)
    assert first.blocked_frac == 0.0 and first.producers_delivering == 1
    # 10 more batches, each waiting 300 ms for a credit: the cumulative means move to 150.
    write(20, 100.0, 150.0)
    second = window.read(0.2)
    assert abs(second.blocked_frac - 0.75) < 1e-9
    write(20, 100.0, 150.0)
    assert window.read(0.2).producers_delivering == 0


def test_jumps_to_the_count_the_evidence_asks_for():
    scaler = AutoScaler(max_producers=8, capacity=3)
    starving = Evidence(0.6, 0.0, 0.0, 20, 0.3, 1, prep_ms_mean=330.0, step_ms_mean=100.0)
    assert [scaler.decide(1, starving) for _ in range(ADD_STREAK)][-1] == 3  # ceil(1.2 x 3.3) = 4 in all
    capped = AutoScaler(max_producers=2, capacity=3)
    assert [capped.decide(1, starving) for _ in range(ADD_STREAK)][-1] == 1
