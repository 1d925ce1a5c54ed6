"""benchmarks/batching.py: the generated corpus and the padding figures of both plans (no TensorFlow)."""

from __future__ import annotations

import math

from stoker.benchmarks import batching, suite


def test_ljspeech_like_lengths_are_deterministic_and_in_range() -> None:
    first, again = batching.ljspeech_like(500, seed=3), batching.ljspeech_like(500, seed=3)
    assert first == again
    seconds = [s.duration_s for s in first]
    assert batching.MIN_S <= min(seconds) and max(seconds) <= batching.MAX_S
    assert 6.0 < sum(seconds) / len(seconds) < 7.2  # LJSpeech's mean is 6.6 s
    assert all(s.num_frames == 1 + int(s.duration_s * 22050) // 256 for s in first)


def test_padding_figures_of_both_plans() -> None:
    result = batching.run(batching.BatchingPlan(clips=3000, throughput=False), log_fn=lambda text: None)
    fixed, framed = result["fixed"], result["frame_budget"]
    # The buckets' shapes of 16 rows, and the epoch's one short batch of fewer (only real rows).
    assert len(fixed["shapes"]) <= batching.FIXED_BUCKETS + 1 and [s[0] for s in fixed["shapes"][:-1]] == [16] * (
        len(fixed["shapes"]) - 1)
    # The budget is the fixed plan's largest batch: the same peak memory.
    assert result["budget_frames"] == max(b * t for b, _, t in fixed["shapes"])
    assert len(framed["shapes"]) <= batching.BUDGET_BUCKETS + 1
    assert all(b * t <= result["budget_frames"] for b, _, t in framed["shapes"])
    assert framed["frames_useful_frac"] > fixed["frames_useful_frac"] + 0.03
    assert framed["within_10pct_frac"] == 1.0
    useful = result["targets"][0]
    assert math.isclose(useful["value"], useful["ratio"]["numerator"] / useful["ratio"]["denominator"])
    items = [t for t in suite.targets({"batching": result}) if t["section"] == "batching"]
    assert len(items) == 6 and all(isinstance(t["met"], bool) for t in items)
    for r in (fixed, framed):  # the plan of real rows against the one of empty rows, in the same run
        old = r["frames_useful_frac_empty_rows"]
        assert r["frames_useful_frac"] >= r["frames_useful_frac_fixed_rows"] >= old - batching.EMPTY_ROWS_TOLERANCE
    assert all(t["met"] for t in items if "plan of empty rows" in t["what"])
    assert "frame budget" in batching.render(result)


def test_transforms_cost_figures() -> None:
    from stoker.benchmarks import transforms

    result = transforms.run(transforms.TransformsPlan(repetitions=1, conventions=("vocos",)))
    target, vocos = result["targets"]
    assert result["clips"] == 64 and target["limit"] == vocos["limit"] == transforms.TARGET_RATIO
    assert math.isclose(target["value"], result["transformed_ms_per_clip"]["median"]
                        / result["plain_ms_per_clip"]["median"])
    conventions = result["conventions"]
    assert math.isclose(vocos["value"], conventions["ms_per_clip"]["vocos"]["mel"]["median"]
                        / conventions["ms_per_clip"]["default"]["mel"]["median"])
    # the same clips each way: 24 kHz makes 24000 / 22050 as many frames (within one a clip)
    assert abs(conventions["frames"]["vocos"] - conventions["frames"]["default"] * 24000 / 22050) <= 64
    assert [t["section"] for t in suite.targets({"transforms": result})] == ["transforms"] * 2
    assert "trim + loudness + mel norm" in transforms.render(result) and "vocos" in transforms.render(result)
