"""Where a neural feature extractor runs (``python -m stoker.benchmarks.producer_models``).

One encoder (a convolutional encoder with a vector-quantised codebook: mel -> codes at a quarter
of the frame rate, as docs/examples/neural_features.py's, wider, so that it costs about as much
as the training step) and one trainer (text -> codes, cross-entropy, and a coarse mel), on the
demo data, in real runs (``python -m stoker``, 2 producers, numpy log-mels), four ways:

    none        the trainer alone: no encoder anywhere (its codes input is zeros)
    in step     (a) the encoder inside the training step, as common trainers run it: every
                step encodes its batch's mels before the model's forward pass
    producers   (b) the encoder as a producer model (transforms.models): the producers encode
                each batch, the trainer reads the codes
    cache       (c) as (b), from a feature cache that ``python run.py precompute`` filled first:
                no encoder runs at all (the log-mels come from the cache too, as for ``none``)

From each run's summary.json: samples/s after warm-up and the trainer's wait share
(``data_wait_frac``), medians over ``repetitions`` rounds of the four (alternated). Ratios:
(b) / (a) (target >= 1.3 where the encoder costs about a step) and (c) / none (target >=
0.95). ``none`` also reads its log-mels from the cache, so that (c) is compared with a run
doing the same work but the codes. On a CPU-only host the producers
and the trainer share the cores: the encoder moved to the producers still takes the trainer's
CPU, which the figures show.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.benchmarks.common import QUIET_ENV, STOKER, BenchError, ratio, run_alone, spread, table

# The encoder's width: at B = 16 on the demo's buckets its forward pass costs about as much as
# the trainer's step (measured on the 2-core reference host; see docs/BENCHMARKS.md).
WIDTH = 256
GROUP = 4  # mel frames per code
CODEBOOK = 256
CODE_DIM = 32
SEED = 7
N_MELS = 80
BATCH_SIZE = 16
PRODUCERS = 2
MODEL_FIELDS = f"codes:int32:T/{GROUP}:-1"
ENCODER = "stoker.benchmarks.producer_models:encoder"
TRAINERS = {"none": "plain", "in step": "in_step", "producers": "on_codes", "cache": "on_codes"}
TARGET_PRODUCERS_VS_STEP = 1.3
TARGET_CACHE_VS_NONE = 0.95
RUN_TIMEOUT_S = 600.0


@dataclass
class ProducerModelsPlan:
    steps: int = 120
    repetitions: int = 2  # of each way, alternated (the order reversed every other round): medians

    @classmethod
    def quick(cls) -> "ProducerModelsPlan":
        return cls(steps=60, repetitions=1)


def encoder() -> Any:
    """The producer model: mel, mel_lengths -> codes [B, T/4] (seeded weights, the same in
    every process)."""
    import keras
    import tensorflow as tf
    from keras import layers

    def init(n: int) -> Any:
        return keras.initializers.GlorotUniform(seed=SEED + n)

    mel = keras.Input((None, N_MELS), name="mel")
    lengths = keras.Input((), dtype="int32", name="mel_lengths")

    def masked(a: Any) -> Any:
        x, n = a
        return x * tf.sequence_mask(n, tf.shape(x)[1], dtype=x.dtype)[..., None]

    x = layers.Lambda(masked)([mel, lengths])
    x = layers.Lambda(lambda a: tf.pad(a, [[0, 0], [0, -tf.shape(a)[1] % GROUP], [0, 0]]))(x)
    x = layers.Conv1D(WIDTH, GROUP, strides=GROUP, activation="relu", kernel_initializer=init(1))(x)
    for n in range(2, 7):
        x = x + layers.Conv1D(WIDTH, 5, padding="same", activation="relu", kernel_initializer=init(n))(x)
    z = layers.Dense(CODE_DIM, kernel_initializer=init(7))(x)
    book = tf.constant(keras.initializers.GlorotUniform(seed=SEED)((CODEBOOK, CODE_DIM)))
    codes = layers.Lambda(lambda v: tf.argmin(tf.reduce_sum(v * v, -1, keepdims=True) - 2.0 * tf.einsum(
        "btd,kd->btk", v, book) + tf.reduce_sum(book * book, -1), axis=-1, output_type=tf.int32))(z)
    return keras.Model({"mel": mel, "mel_lengths": lengths}, {"codes": codes}, name="bench_encoder")


def _trainer(vocab_size: int, codes_from: str) -> Any:
    """Text -> codes (and a coarse mel): the same model whichever way it gets its codes."""
    import keras
    import tensorflow as tf
    from keras import layers

    frozen = encoder() if codes_from == "step" else None

    class CodesModel(keras.Model):
        def __init__(self) -> None:
            super().__init__(name="bench_codes")
            self.embed = layers.Embedding(vocab_size, 128)
            self.text = [layers.Conv1D(128, 5, padding="same", activation="relu") for _ in range(2)]
            self.query = layers.Dense(128)
            self.attention = layers.MultiHeadAttention(num_heads=2, key_dim=64)
            self.logits = layers.Dense(CODEBOOK, dtype="float32")
            self.mel = layers.Dense(N_MELS * GROUP, dtype="float32")

        def call(self, inputs: dict[str, Any], training: bool = False) -> dict[str, Any]:
            frames = tf.shape(inputs["mel"])[1]
            steps = (frames + GROUP - 1) // GROUP
            if codes_from == "step":
                codes = tf.stop_gradient(frozen({"mel": inputs["mel"], "mel_lengths": inputs["mel_lengths"]})["codes"])
            elif codes_from == "batch":
                codes = inputs["codes"]
            else:
                codes = tf.zeros([tf.shape(inputs["mel"])[0], steps], tf.int32)
            x = self.embed(inputs["tokens"])
            for conv in self.text:
                x = x + conv(x)
            position = tf.cast(tf.range(steps), tf.float32)[None, :, None] / tf.cast(steps, tf.float32)
            q = self.query(tf.concat([tf.sin(position * tf.range(1.0, 33.0)), tf.cos(position * tf.range(1.0, 33.0))],
                                     -1))
            q = tf.tile(q, [tf.shape(x)[0], 1, 1])
            h = q + self.attention(q, x)
            valid = (inputs["mel_lengths"] + GROUP - 1) // GROUP
            mask = tf.sequence_mask(valid, steps, dtype=tf.float32)
            ce = keras.losses.sparse_categorical_crossentropy(tf.maximum(codes, 0), self.logits(h), from_logits=True)
            loss = tf.reduce_sum(ce * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)
            mel = tf.reshape(self.mel(h), [tf.shape(h)[0], steps * GROUP, N_MELS])[:, :frames]
            return {"mel": mel, "losses": {"codes_ce": loss}}

    return CodesModel()


def plain(vocab_size: int, n_mels: int) -> Any:
    return _trainer(vocab_size, "zeros")


def in_step(vocab_size: int, n_mels: int) -> Any:
    return _trainer(vocab_size, "step")


def on_codes(vocab_size: int, n_mels: int) -> Any:
    return _trainer(vocab_size, "batch")


def _stoker(args: list[str], run_dir: Path) -> dict[str, Any]:
    argv = [*STOKER, *args, "--run-dir", str(run_dir), "--log-level", "WARNING"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, **QUIET_ENV})
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv[2:])} exited with {done.returncode}: {done.stderr[-800:]}")
    return json.loads((run_dir / "summary.json").read_text())


def _figures(summaries: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """One way's figures: the median over its repetitions (all of them kept in ``spread``)."""
    def median(key: str) -> float:
        return statistics.median(s[key] for s in summaries)

    return {"samples_per_s": median("samples_per_s"), "data_wait_frac": median("data_wait_frac"),
            "step_ms_mean": median("step_ms_mean"),
            "spread": {"samples_per_s": spread([s["samples_per_s"] for s in summaries])},
            "model_runs": sum(p.get("model_runs", 0) for p in summaries[0]["producers"]),
            "model_hits": sum(p.get("model_hits", 0) for p in summaries[0]["producers"]), "command": command}


def run(plan: ProducerModelsPlan, log_fn: Any = None) -> dict[str, Any]:
    say = log_fn or (lambda text: None)
    work = Path(tempfile.mkdtemp(prefix="stoker-bench-models-"))
    common = ["--producers", str(PRODUCERS), "--batch-size", str(BATCH_SIZE), "--model-start-delay", "1",
              "--set", "features.backend=numpy", "--set", "trainer.val_clips=0",
              "--set", "trainer.checkpoint_every_steps=0", "--set", "trainer.log_every_steps=20"]
    models = ["--producer-models", ENCODER, "--set", f"transforms.model_fields={MODEL_FIELDS}"]
    cache = ["--set", f"data.feature_cache={work / 'cache'}"]
    try:
        started = time.monotonic()
        _stoker(["precompute", "--producers", str(PRODUCERS), "--batch-size", str(BATCH_SIZE),
                 "--set", "trainer.val_clips=0", *models, *cache], work / "precompute")
        say(f"producer models: cache filled by precompute in {time.monotonic() - started:.1f} s")
        ways = {"none": cache, "in step": [], "producers": models, "cache": models + cache}
        measured: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
        for round_ in range(plan.repetitions):
            for way in (list(ways) if round_ % 2 == 0 else list(ways)[::-1]):
                model = f"stoker.benchmarks.producer_models:{TRAINERS[way]}"
                summary = _stoker(["--model", model, "--steps", str(plan.steps), *common, *ways[way]],
                                  work / f"run-{way.replace(' ', '-')}-{round_}")
                measured[way].append(summary)
                say(f"producer models: {way}: {summary['samples_per_s']:.1f} samples/s, wait "
                    f"{summary['data_wait_frac']:.3f}, step {summary['step_ms_mean']:.1f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs = {way: _figures(summaries, " ".join(["python run.py", "--model",
                                                f"stoker.benchmarks.producer_models:{TRAINERS[way]}", "--steps",
                                                str(plan.steps), *common, *ways[way]]))
            for way, summaries in measured.items()}
    sps = {way: r["samples_per_s"] for way, r in runs.items()}
    producers_vs_step = ratio(sps["producers"], sps["in step"], target=TARGET_PRODUCERS_VS_STEP)
    cache_vs_none = ratio(sps["cache"], sps["none"], target=TARGET_CACHE_VS_NONE)
    return {"runs": runs, "steps": plan.steps, "batch_size": BATCH_SIZE, "producers": PRODUCERS, "width": WIDTH,
            "producers_vs_in_step": producers_vs_step, "cache_vs_none": cache_vs_none,
            "targets": [{"what": "encoder in the producers / in the step, samples/s",
                         "value": producers_vs_step["value"],
                         "limit": TARGET_PRODUCERS_VS_STEP, "ratio": producers_vs_step,
                         "met": producers_vs_step["value"] >= TARGET_PRODUCERS_VS_STEP},
                        {"what": "codes from the cache / no encoder, samples/s", "value": cache_vs_none["value"],
                         "limit": TARGET_CACHE_VS_NONE, "ratio": cache_vs_none,
                         "met": cache_vs_none["value"] >= TARGET_CACHE_VS_NONE}]}


def render(result: dict[str, Any]) -> str:
    rows = [[way, f"{r['samples_per_s']:.1f}", f"{r['data_wait_frac']:.3f}", f"{r['step_ms_mean']:.1f}",
             r["model_runs"], r["model_hits"]] for way, r in result["runs"].items()]
    return "\n".join([
        table(["encoder", "samples/s", "wait share", "step ms", "model runs", "cached clips"], rows),
        f"(b) producers / (a) in step: {result['producers_vs_in_step']['value']:.2f} (target >= "
        f"{TARGET_PRODUCERS_VS_STEP}); (c) cache / none: {result['cache_vs_none']['value']:.2f} "
        f"(target >= {TARGET_CACHE_VS_NONE})"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    plan = ProducerModelsPlan.quick() if args.quick else ProducerModelsPlan()
    return run_alone("producer_models", lambda log: run(plan, log), render, args.out)


if __name__ == "__main__":
    sys.exit(main())
