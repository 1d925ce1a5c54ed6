"""``python run.py diagnose RUN_DIR``: where the time went, from a run's files alone.

Reads ``metrics.jsonl`` (one row per step), ``summary.json`` (producers' figures),
``rejected.jsonl``, ``config.yaml`` and, when recorded, ``gpu.jsonl``. Reports:

- step time (mean, p50, p95, p99) and the share of time spent waiting for data;
- queue depth over time (a sparkline) and as a histogram;
- starvation episodes: runs of consecutive steps that found the queue empty;
- periodic patterns in wait time: the autocorrelation of the per-step wait, its
  strongest peak as a period (steps and seconds) and its strength (0..1);
- per producer: batches, samples, time to prepare a batch (its rate), and time a
  prepared batch waited for a credit (the sign that the trainer is the limit);
- rejected samples by reason; GPU utilisation of the data and model GPUs;
- the verdict with the numbers behind it, and the cure as a command line; where the host's
  cores were all busy with the producers beside the trainer (summary.json's ``host_cpu``), that
  the host's CPU is the limit, and the cure that moves work off it instead of more producers.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from .shared.errors import UserError
from .shared.metrics import (HOST_CPU_LIMIT, PRODUCER_MARGIN, WAIT_BOUND_FRAC, host_cpu_limited, read_jsonl,
                             recommend_producers, verdict)
from .shared.runfiles import CONFIG, GPU, METRICS, REJECTED, SUMMARY, TRAINED_BY_FEED

SPARK = " ▁▂▃▄▅▆▇█"
SPARK_WIDTH = 64
# A period is reported only when the autocorrelation peak is at least this strong;
# below it, noise in a few hundred steps produces spurious peaks.
MIN_PERIOD_STRENGTH = 0.3
# Shortest period considered, in time bins (lag 1 is dominated by smoothness) and in
# steps (a wait at every step is chronic starvation, not a pattern).
MIN_PERIOD_BINS = 2
MIN_PERIOD_STEPS = 3
# Time bins of the wait signal are half a step, but never finer than this.
MIN_BIN_S = 0.01
# Fewer steps than this cannot show a pattern worth reporting.
MIN_STEPS_FOR_PERIOD = 16
# Periodicity is looked for only when waiting costs at least this share of the time.
MIN_WAIT_FRAC_FOR_PERIOD = 0.01
# Below this share of valid frames the padding is named as waste (four equal-count buckets
# on an LJSpeech-like length distribution compute ~13% padding, i.e. 0.87).
PADDING_USEFUL_MIN = 0.85


class DiagnoseError(UserError):
    """The directory is not a run (no metrics.jsonl)."""


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def sparkline(values: Sequence[float], top: float, width: int = SPARK_WIDTH) -> str:
    """Means of ``values`` in ``width`` columns, drawn with block characters up to ``top``."""
    if not len(values) or top <= 0:
        return ""
    cols = np.array_split(np.asarray(values, dtype=float), min(width, len(values)))
    levels = len(SPARK) - 1
    return "".join(SPARK[int(round(min(c.mean() / top, 1.0) * levels))] for c in cols)


def starvation_episodes(depths: Sequence[int], waits: Sequence[float]) -> list[dict[str, Any]]:
    """Runs of consecutive steps whose queue was empty: start step, length, total wait."""
    episodes: list[dict[str, Any]] = []
    start = None
    for i, depth in enumerate([*depths, 1]):
        if depth == 0 and start is None:
            start = i
        elif depth != 0 and start is not None:
            episodes.append({"start_step": start + 1, "steps": i - start,
                             "wait_ms": round(float(sum(waits[start:i])), 3)})
            start = None
    return episodes


def autocorrelation(series: Sequence[float]) -> np.ndarray:
    """Normalised autocorrelation for lags 0..n-1 (1.0 at lag 0; zeros if constant)."""
    x = np.asarray(series, dtype=float)
    x = x - x.mean()
    denom = float(np.dot(x, x))
    if denom == 0:
        return np.zeros(len(x))
    n = len(x)
    spectrum = np.fft.rfft(x, 2 * n)
    acf = np.fft.irfft(spectrum * np.conj(spectrum))[:n]
    # The biased estimate (divided by n at every lag) damps long lags, where few pairs
    # make noisy peaks; so the fundamental period wins over its multiples.
    return acf / denom


def wait_signal(rows: Sequence[dict[str, Any]], bin_s: float) -> np.ndarray:
    """Share of each ``bin_s`` time bin that the trainer spent waiting (a uniform time series).

    Periods are found in time, not in steps: a stall every 2 s spans a varying number of
    steps when steps are not all alike, which would smear a step-domain pattern.
    """
    if not rows:
        return np.zeros(0)
    end = rows[-1]["t"]
    signal = np.zeros(int(end / bin_s) + 2)
    for r in rows:
        wait_end = r["t"] - r["step_ms"] / 1000
        wait_start = max(wait_end - r["wait_ms"] / 1000, 0.0)
        if wait_end <= wait_start:
            continue
        first, last = int(wait_start / bin_s), int(wait_end / bin_s)
        for b in range(first, last + 1):
            overlap = min(wait_end, (b + 1) * bin_s) - max(wait_start, b * bin_s)
            if overlap > 0:
                signal[b] += overlap / bin_s
    return signal


def find_period(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The strongest periodic pattern in the trainer's waiting, or None.

    The waiting is rasterised onto a uniform time grid (:func:`wait_signal`); the
    strongest local maximum of its autocorrelation (above MIN_PERIOD_STRENGTH) is the
    period, refined to a fraction of a bin with a parabola; a strong peak at a multiple
    of a nearly as strong shorter one yields the shorter one.
    """
    if len(rows) < MIN_STEPS_FOR_PERIOD:
        return None
    intervals = [(r["wait_ms"] + r["step_ms"]) / 1000 for r in rows[1:]]
    step_s = float(np.mean(intervals)) if intervals else 0.0
    bin_s = max(MIN_BIN_S, float(np.median(intervals)) / 2) if intervals else MIN_BIN_S
    signal = wait_signal(rows[1:], bin_s)
    n = len(signal)
    if n < 4 * MIN_PERIOD_BINS:
        return None
    # A wait at every step (chronic starvation) is no periodic pattern: a moving average
    # over MIN_PERIOD_STEPS steps removes the step rate before looking for periods.
    min_lag = max(MIN_PERIOD_BINS, int(np.ceil(MIN_PERIOD_STEPS * step_s / bin_s)))
    smoothed = np.convolve(signal, np.ones(min_lag) / min_lag, mode="same")
    acf = autocorrelation(smoothed)
    # Peaks are looked for only past the first zero crossing: before it, the correlation
    # of each wait with itself (and the smoothing) decays and makes no period.
    below = np.nonzero(acf[min_lag:n // 2] < 0)[0]
    if not len(below):
        return None
    start = min_lag + int(below[0])
    best_lag, best = None, MIN_PERIOD_STRENGTH
    for lag in range(start, n // 2):
        if acf[lag] >= best and acf[lag] >= acf[lag - 1] and acf[lag] >= acf[lag + 1]:
            best_lag, best = lag, float(acf[lag])
    if best_lag is None:
        return None
    for divisor in range(best_lag // start, 1, -1):
        lag = round(best_lag / divisor)
        lo, hi = max(lag - 1, start), lag + 2
        if abs(lag * divisor - best_lag) <= divisor and acf[lo:hi].max() >= 0.8 * best:
            best_lag = max(range(lo, hi), key=lambda k: acf[k])
            best = float(acf[best_lag])
            break
    y0, y1, y2 = acf[best_lag - 1], acf[best_lag], acf[best_lag + 1]
    curvature = y0 - 2 * y1 + y2
    offset = 0.5 * (y0 - y2) / curvature if curvature < 0 else 0.0
    period_s = (best_lag + offset) * bin_s
    return {"period_s": round(float(period_s), 3),
            "period_steps": round(float(period_s / step_s), 2) if step_s else None,
            "strength": round(best, 3)}


def reason_category(reason: str) -> str:
    """A rejection reason without its particulars (file names, numbers)."""
    head = reason.split(":")[0]
    return re.sub(r"\S*\d\S*", "N", head).strip()


def analyse(run_dir: Path) -> dict[str, Any]:
    """Everything ``diagnose`` reports, as data."""
    run_dir = Path(run_dir)
    rows, summary, config = _run_files(run_dir)
    capacity = int(summary.get("capacity") or config.get("pipeline", {}).get("buffer_size", 3))
    steps = len(rows)
    step_ms = [r["step_ms"] for r in rows]
    waits = [r["wait_ms"] for r in rows]
    depths = [r["queue_depth"] for r in rows]
    steady_waits = waits[1:]
    busy = sum(steady_waits) + sum(step_ms)
    wait_frac = sum(steady_waits) / busy if busy > 0 else None
    depth_mean = float(np.mean(depths)) if depths else None
    producers = summary.get("producers", [])
    producer_rows = producer_report(producers, rows)
    rejected = read_jsonl(run_dir / REJECTED)
    by_reason = Counter(reason_category(r.get("reason", "")) for r in rejected)
    kind = verdict(wait_frac, depth_mean, capacity)
    alive = sum(1 for p in producers if p.get("batches"))
    step_mean = float(np.mean(step_ms)) if step_ms else None
    recommended = recommend_producers(kind, step_mean, [p.get("prep_ms_mean") for p in producers], alive)
    host_cpu = summary.get("host_cpu")
    host_limited = host_cpu_limited(kind, host_cpu)
    if host_limited:
        recommended = min(recommended, max(alive, 1))  # more on these cores cannot help
    prep_means = [p["prep_ms_mean"] for p in producer_rows if p["prep_ms_mean"]]
    replicas = int(summary.get("replicas") or config.get("devices", {}).get("replicas") or 1)
    report = {
        "run_dir": str(run_dir),
        "steps": steps,
        "capacity": capacity,
        "replicas": replicas,
        **_step_times(step_ms, waits, wait_frac),
        "queue_depth": {
            "mean": depth_mean,
            "histogram": {str(d): depths.count(d) for d in range(capacity + 1)},
            "sparkline": sparkline(depths, capacity),
        },
        # A pattern in waits that are a negligible share of the time is not worth reporting.
        "period": find_period(rows) if (wait_frac or 0) >= MIN_WAIT_FRAC_FOR_PERIOD else None,
        "producers": producer_rows,
        "rejected": {"total": len(rejected), "by_reason": dict(by_reason.most_common())},
        "gpu": gpu_report(run_dir),
        "padding": padding_report(rows),
        "verdict": kind,
        "limit": HOST_CPU_LIMIT if host_limited else kind,
        "host_cpu": host_cpu,
        "evidence": {
            "data_wait_frac": wait_frac, "wait_bound_frac": WAIT_BOUND_FRAC, "queue_depth_mean": depth_mean,
            "replicas": replicas, **_rates(replicas, step_mean, prep_means),
            "producers_delivering": alive, "margin": PRODUCER_MARGIN,
        },
        "recommended_producers": recommended,
        "cure": (host_cure(config, feed=summary.get("trained_by") == TRAINED_BY_FEED) if host_limited else
                 cure_command(config, kind, recommended, alive, feed=summary.get("trained_by") == TRAINED_BY_FEED)),
        "host_cores": summary.get("host_cores"),
        "exit_reason": summary.get("exit_reason"),
    }
    report["starvation"] = starvation_report(depths, waits)
    return report


def _step_times(step_ms: Sequence[float], waits: Sequence[float], wait_frac: float | None) -> dict[str, Any]:
    """The step time's and the data wait's figures, as the report holds them."""
    return {
        "step_ms": {"mean": float(np.mean(step_ms)) if step_ms else None, "p50": percentile(step_ms, 50),
                    "p95": percentile(step_ms, 95), "p99": percentile(step_ms, 99)},
        "wait_ms": {"mean": float(np.mean(waits)) if waits else None, "p95": percentile(waits, 95),
                    "first": waits[0] if waits else None},
        "data_wait_frac": wait_frac,
    }


def _rates(replicas: int, step_mean: float | None, prep_means: Sequence[float]) -> dict[str, float | None]:
    """The trainer's demand and the producers' rate, in replica batches per second: a step of N
    model replicas takes N replica batches, made by a producer as one planned batch."""
    demand = replicas * 1000 / step_mean if step_mean else None
    rate = replicas * 1000 / float(np.mean(prep_means)) if prep_means else None
    return {"trainer_demand_batches_per_s": round(demand, 3) if demand else None,
            "producer_rate_batches_per_s": round(rate, 3) if rate else None}


def starvation_report(depths: Sequence[int], waits: Sequence[float]) -> dict[str, Any]:
    """Runs of steps that found the queue empty: how many, how long, the worst five."""
    episodes = starvation_episodes(depths, waits)
    return {"episodes": len(episodes), "starved_steps": sum(e["steps"] for e in episodes),
            "longest_steps": max((e["steps"] for e in episodes), default=0),
            "worst": sorted(episodes, key=lambda e: -e["wait_ms"])[:5]}


def _run_files(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """metrics.jsonl's rows, summary.json and config.yaml of a run ({} for a file not there yet)."""
    if not (run_dir / METRICS).exists():
        raise DiagnoseError(f"{run_dir} has no metrics.jsonl: not a stoker run directory")
    rows = read_jsonl(run_dir / METRICS)
    summary = json.loads((run_dir / SUMMARY).read_text()) if (run_dir / SUMMARY).exists() else {}
    config = (yaml.safe_load((run_dir / CONFIG).read_text()) or {}) if (run_dir / CONFIG).exists() else {}
    return rows, summary, config


def producer_report(producers: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each producer's figures: batches, rate, and how long its prepared batches waited for credit."""
    per_producer_steps = Counter(r.get("producer") for r in rows)
    out = []
    for p in producers:
        prep = p.get("prep_ms_mean")
        credit = p.get("credit_wait_ms_mean")
        out.append({
            "id": p.get("id"), "host": p.get("host"), "status": p.get("status"),
            "batches": p.get("batches", 0), "samples": p.get("samples", 0), "rejected": p.get("rejected", 0),
            "trained_batches": per_producer_steps.get(p.get("id"), 0),
            "prep_ms_mean": prep, "rate_batches_per_s": round(1000 / prep, 3) if prep else None,
            "credit_wait_ms_mean": credit,
            "blocked_frac": round(credit / (credit + prep), 4) if prep and credit is not None else None,
        })
    return out


def padding_report(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """How much of the computed frames were padding (None when the rows do not say)."""
    computed = sum(int(r.get("frames_computed", 0)) for r in rows)
    if not computed:
        return None
    useful = sum(int(r.get("frames", 0)) for r in rows) / computed
    return {"frames_useful_frac": round(useful, 4), "waste": useful < PADDING_USEFUL_MIN}


def gpu_report(run_dir: Path) -> dict[str, Any] | None:
    rows = read_jsonl(run_dir / GPU)
    if not rows:
        return None
    out: dict[str, Any] = {}
    for role in sorted({r.get("role", "?") for r in rows}):
        util = [r["util"] for r in rows if r.get("role") == role and r.get("util") is not None]
        mem = [r["mem_used_mb"] for r in rows if r.get("role") == role and r.get("mem_used_mb") is not None]
        index = next((r.get("gpu") for r in rows if r.get("role") == role), None)
        out[role] = {"gpu": index, "samples": len(util),
                     "util_mean": round(float(np.mean(util)), 1) if util else None,
                     "util_p5": percentile(util, 5), "util_p95": percentile(util, 95),
                     "util_sparkline": sparkline(util, 100.0),
                     "mem_used_mb_max": max(mem) if mem else None}
    return out


def cure_command(config: dict[str, Any], kind: str, recommended: int, current: int, feed: bool = False) -> str:
    """What to run with the recommended producers: the command line, or for a run of
    stoker.Feed in the user's own loop, the feed's option."""
    if feed:
        if kind == "consumer-bound" and recommended >= current:
            return "no change needed for the input pipeline: the training loop is the limit"
        return f"stoker.Feed(..., producers={recommended})"
    data = config.get("data", {}).get("path", "")
    model = config.get("trainer", {}).get("model", "tiny")
    batch = config.get("batching", {}).get("batch_size")
    parts = ["python run.py"]
    if data:
        parts.append(f"--data {data}")
    parts.append(f"--model {model}")
    if batch:
        parts.append(f"--batch-size {batch}")
    devices = config.get("devices", {})
    for key, flag in (("data_gpu", "--data-gpu"), ("model_gpu", "--model-gpu")):
        if devices.get(key) is not None:
            parts.append(f"{flag} {devices[key]}")
    if (devices.get("replicas") or 1) > 1 and not isinstance(devices.get("model_gpu"), str):
        parts.append(f"--replicas {devices['replicas']}")  # a --model-gpu list names them already
    parts.append(f"--producers {recommended}")
    if kind == "consumer-bound":
        if recommended >= current:
            return "no change needed for the input pipeline: the trainer is the limit"
        return f"the trainer is the limit and fewer producers suffice: {' '.join(parts)}"
    return " ".join(parts)


def host_cure(config: dict[str, Any], feed: bool = False) -> str:
    """What to do when the host's CPU is the limit: the producers' work off its cores, on
    another host or on the data GPU (more producers here would share the same cores)."""
    data = config.get("data", {}).get("path", "") or "DIR"
    here = "stoker.Feed(..., producers=0)" if feed else "--producers 0 here"
    return (f"move the producers' work off this host's cores: run them on another host (there: python run.py "
            f"produce --connect tcp://THIS_HOST:PORT --data {data}; {here}), or compute the features on the data "
            f"GPU (--data-gpu N)")


def host_lines(report: dict[str, Any]) -> list[str]:
    """The host's CPU over the run (summary.json's host_cpu), and whether it was the limit."""
    h = report.get("host_cpu")
    if not h:
        return []
    window = h.get("window_s") or 0.0
    trainer = h["trainer_cpu_s"] / window if window else None
    producing = h["local_prep_s"] / window if window else None
    busy = h.get("busy_frac")
    line = (f"host cpu      {h.get('cores')} cores {_fmt(busy * 100 if busy is not None else None)}% busy over "
            f"{window:.1f} s: the trainer process used {_fmt(trainer, '.2f')} cores; {h.get('local_producers')} "
            f"producers here prepared batches {_fmt(producing, '.2f')} s a second (their prep time, warm-up's "
            f"batches included)")
    if report["limit"] != HOST_CPU_LIMIT:
        return [line]
    return [line, f"limit         the host's CPU, not the producer count: {report['verdict']} with every core "
                  f"busy, and more producers on this host would share the same cores"]


def _fmt(value: Any, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def render(report: dict[str, Any]) -> str:
    """The report as text a person reads in a minute."""
    lines = [f"stoker diagnosis of {report['run_dir']} ({report['steps']} steps, {report['exit_reason']})", ""]
    if report["replicas"] > 1:
        lines.append(f"replicas      {report['replicas']}: each step trains one batch per replica, made together as "
                     f"one planned batch; rates below count replica batches")
    s = report["step_ms"]
    lines.append(f"step time     mean {_fmt(s['mean'])} ms  p50 {_fmt(s['p50'])}  p95 {_fmt(s['p95'])}  "
                 f"p99 {_fmt(s['p99'])}")
    wait = report["data_wait_frac"]
    lines.append(f"data wait     {_fmt(wait * 100 if wait is not None else None)}% of the trainer's time after "
                 f"warm-up (first batch waited {_fmt(report['wait_ms']['first'])} ms)")
    lines += _queue_lines(report)
    lines += _input_lines(report)
    lines += _verdict_lines(report)
    return "\n".join(lines)


def _queue_lines(report: dict[str, Any]) -> list[str]:
    """Queue depth over the run, starvation episodes, periodicity."""
    lines = []
    q = report["queue_depth"]
    lines.append(f"queue depth   mean {_fmt(q['mean'], '.2f')} of {report['capacity']}  "
                 f"over time |{q['sparkline']}|")
    total = max(report["steps"], 1)
    for depth, count in q["histogram"].items():
        bar = "#" * int(round(40 * count / total))
        lines.append(f"  depth {depth}: {count:6d} steps  {bar}")
    st = report["starvation"]
    lines.append(f"starvation    {st['episodes']} episodes, {st['starved_steps']} steps found the queue empty, "
                 f"longest {st['longest_steps']} steps")
    for e in st["worst"][:3]:
        lines.append(f"  from step {e['start_step']}: {e['steps']} steps, {e['wait_ms']:.0f} ms waiting")
    period = report["period"]
    if period:
        lines.append(f"periodicity   waiting repeats every {period['period_s']:.2f} s (~{period['period_steps']} steps), "
                     f"strength {period['strength']:.2f}")
    else:
        lines.append("periodicity   no periodic pattern in wait time")
    return lines


def _input_lines(report: dict[str, Any]) -> list[str]:
    """Producers, rejections, padding and the GPUs."""
    lines = ["producers"]
    for p in report["producers"]:
        lines.append(f"  {p['id']:<20} {p['status'] or '':<8} {p['batches']:6d} batches  "
                     f"prepare {_fmt(p['prep_ms_mean'])} ms/batch ({_fmt(p['rate_batches_per_s'], '.2f')}/s)  "
                     f"waits for credit {_fmt(p['credit_wait_ms_mean'])} ms "
                     f"({_fmt(p['blocked_frac'] * 100 if p['blocked_frac'] is not None else None)}% blocked)")
    rej = report["rejected"]
    lines.append(f"rejected      {rej['total']} samples")
    for reason, count in list(rej["by_reason"].items())[:8]:
        lines.append(f"  {count:6d}  {reason}")
    pad = report.get("padding")
    if pad:
        note = (f": padding wastes {100 * (1 - pad['frames_useful_frac']):.0f}% of the trainer's frames; more shape "
                "buckets (--set batching.num_buckets=8) or frame-budget batches (--max-frames N) cut it"
                if pad["waste"] else "")
        lines.append(f"padding       {_fmt(pad['frames_useful_frac'] * 100)}% of the frames the steps computed are "
                     f"valid{note}")
    gpu = report["gpu"]
    if gpu:
        for role, g in gpu.items():
            lines.append(f"gpu {role:<9} GPU {g['gpu']}: utilisation mean {_fmt(g['util_mean'])}% "
                         f"(p5 {_fmt(g['util_p5'])}, p95 {_fmt(g['util_p95'])}) |{g['util_sparkline']}|")
    else:
        lines.append("gpu           not recorded (no GPU, or NVML unavailable)")
    return lines


def _verdict_lines(report: dict[str, Any]) -> list[str]:
    ev = report["evidence"]
    wait = report["data_wait_frac"]
    lines = [""]
    lines.append(f"verdict       {report['verdict']}: waited {_fmt(wait * 100 if wait is not None else None)}% "
                 f"(bound {ev['wait_bound_frac'] * 100:.0f}%), queue mean {_fmt(ev['queue_depth_mean'], '.2f')}"
                 f"/{report['capacity']}; trainer wants {_fmt(ev['trainer_demand_batches_per_s'], '.2f')} "
                 f"batches/s{' (' + str(ev['replicas']) + ' replicas x steps/s)' if ev['replicas'] > 1 else ''}, "
                 f"one producer makes {_fmt(ev['producer_rate_batches_per_s'], '.2f')}/s")
    lines += host_lines(report)
    if report["limit"] == HOST_CPU_LIMIT:
        lines.append(f"advice        no more producers here ({report['recommended_producers']}); {report['cure']}")
        return lines
    lines.append(f"advice        {report['recommended_producers']} producers "
                 f"(= ceil({ev['margin']} x demand / rate)); {report['cure']}")
    cores = report.get("host_cores")
    if cores and report["verdict"] == "producer-bound" and report["recommended_producers"] > cores:
        lines.append(f"              the run's host has {cores} cores: CPU-bound producers beyond that do not run "
                     "faster; put them on the data GPU (--data-gpu), or on other hosts (run.py produce)")
    return lines
