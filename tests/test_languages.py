"""End-to-end: ``python run.py --data DIR`` on Persian and mixed Persian/English datasets,
with each built-in front-end; the vocabulary in the run, on resume and in synth."""

from __future__ import annotations

import json

import pytest

from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.consumer.index.index import build_index
from stoker.shared.text import Characters, make_frontend, normalize
from tests.procs import read_json, read_jsonl, run_cli
from tests.speech import make_mixed_dataset, make_persian_dataset
from tests.trained import check_run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# Small, fast runs: a tiny model, CPU log-mels, no held-out clips (every clip trains), one
# bucket shape (the step traced for it and the short batch only).
FAST = ["--model", "tiny", "--batch-size", "4", "--producers", "1", "--model-start-delay", "0.2",
        "--record-samples", "--set", "features.backend=numpy", "--set", "trainer.val_clips=0",
        "--set", "trainer.log_every_steps=5", "--set", "batching.num_buckets=1"]


def test_persian_run_characters_then_resume_and_synth(tmp_path):
    made = make_persian_dataset(tmp_path / "fa")
    run_dir = tmp_path / "run"
    result = run_cli("--data", str(tmp_path / "fa"), "--language", "fa", "--epochs", "2", "--run-dir", str(run_dir),
                     *FAST, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    check_run(run_dir, 2, set(made))
    vocab = json.loads((run_dir / "vocab.json").read_text(encoding="utf-8"))
    units = {normalize(text, "fa")[0] for text, _, _ in made.values()}
    assert vocab["frontend"] == "characters" and vocab["languages"] == ["fa"]
    assert vocab["symbols"][2:] == list(Characters().inventory(["fa"]))  # Persian's, whatever the texts
    assert set("".join(units)) < set(vocab["symbols"])
    summary = read_json(run_dir / "summary.json")
    assert summary["rejected"] == 0 and summary["text"]["vocab_size"] == len(vocab["symbols"])
    assert summary["loss_last"] < summary["loss_first"]
    # every clip's frames counted once per epoch; the padding the steps computed is the rest
    rows = read_jsonl(run_dir / "metrics.jsonl")
    index = build_index(DataConfig(path=str(tmp_path / "fa"), index_cache="off"), FeaturesConfig(),
                        TextConfig(language="fa"))
    assert sum(r["frames"] for r in rows) == 2 * sum(s.num_frames for s in index.samples)
    assert summary["frames_useful_frac"] == round(sum(r["frames"] for r in rows)
                                                  / sum(r["frames_computed"] for r in rows), 4) < 1

    # synth speaks any Persian sentence with the run's vocabulary (this one has letters and
    # punctuation no training text has), and names a character it lacks
    new = "ژاله، مؤسسه‌ی ما کجاست؟"
    assert set(normalize(new, "fa")[0]) - set("".join(units)) >= {"ژ", "ؤ", "،", "؟"}
    said = run_cli("synth", str(run_dir), "--text", new, "--frames", "20", "--out", str(tmp_path / "mel.npy"),
                   timeout=120)
    assert said.returncode == 0, said.stderr[-2000:]
    # veh (U+06A4) is Arabic-script but not Persian: no Persian sentence has it
    refused = run_cli("synth", str(run_dir), "--text", "\u06a4\u06a4", "--out", str(tmp_path / "x.npy"))
    assert refused.returncode == 2 and "U+06A4" in refused.stderr.strip().splitlines()[-1]

    # resume keeps the run's vocabulary (and every checkpoint carries it) ...
    resumed = run_cli("--resume", str(run_dir), "--epochs", "3", timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((run_dir / "vocab.json").read_text(encoding="utf-8")) == vocab
    check_run(run_dir, 3, set(made))
    # ... and refuses a vocab.json that would number the tokens otherwise, in one line
    swapped = {**vocab, "symbols": vocab["symbols"][:2] + vocab["symbols"][3:4] + vocab["symbols"][2:3]
               + vocab["symbols"][4:]}
    (run_dir / "vocab.json").write_text(json.dumps(swapped, ensure_ascii=False), encoding="utf-8")
    refused = run_cli("--resume", str(run_dir), "--epochs", "4", timeout=240)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "is not the run's vocab.json" in refused.stderr.strip().splitlines()[-1]


def test_mixed_datasets_run_phonemes(tmp_path):
    """Two datasets mixed by a mix file: a Persian/English one with speaker and language
    columns, and a Persian one whose language the mix names; phonemes for both languages."""
    mixed = make_mixed_dataset(tmp_path / "mix", n=6)
    persian = make_persian_dataset(tmp_path / "fa", n=4)
    (tmp_path / "data.yaml").write_text("datasets:\n  - path: mix\n  - path: fa\n    language: fa\n",
                                        encoding="utf-8")
    run_dir = tmp_path / "run"
    # a model conditioned on speaker and language (and checking the stop target), fed the optional fields
    conditioned = ["--model", "tests.consumer.training.user_models:conditioned", "--set",
                   "batching.fields=speaker_id,language_id,stop"]
    result = run_cli("--data", str(tmp_path / "data.yaml"), "--text-frontend", "phonemes", "--epochs", "1",
                     "--run-dir", str(run_dir), *FAST, *conditioned, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = {f"mix:{i}" for i in mixed} | {f"fa:{i}" for i in persian}
    check_run(run_dir, 1, expected)
    vocab = json.loads((run_dir / "vocab.json").read_text(encoding="utf-8"))
    assert vocab["frontend"] == "phonemes" and vocab["languages"] == ["en", "fa"]
    assert vocab["speakers"] == sorted({speaker for _, speaker, _ in mixed.values()} | {"fa"})
    assert {"phonemizer", "espeakng_loader"} <= set(vocab["engine"])
    assert vocab["symbols"][2:] == list(make_frontend("phonemes").inventory(["en", "fa"]))  # IPA, not Persian script
    assert not any(ch.isalpha() and "\u0600" <= ch <= "\u06ff" for ch in vocab["symbols"])
    summary = read_json(run_dir / "summary.json")
    assert summary["text"]["frontend"] == "phonemes" and summary["exit_reason"] == "completed"


def test_a_dataset_the_front_end_cannot_read_ends_with_one_line(tmp_path):
    made = make_persian_dataset(tmp_path / "fa")
    meta = tmp_path / "fa" / "metadata.csv"
    meta.write_text("".join(f"{i}|{t} \u263a|{t} \u263a\n" for i, (t, _, _) in made.items()), encoding="utf-8")
    result = run_cli("--data", str(tmp_path / "fa"), "--language", "fa", "--steps", "5",
                     "--run-dir", str(tmp_path / "run"), *FAST)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("stoker: error: dataset ") and "Traceback" not in result.stderr
    assert f"{len(made)} of {len(made)} clips were rejected because the text front-end cannot represent" in last
    assert "--set text.max_lost_frac=F" in last
