"""The index on the data users have: Persian, English with digits, mixed languages and
speakers, manifests, train/eval files; every character accounted for (consumer/index/rules.py,
shared/dataset/layouts.py, shared/text.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.consumer.feed import validation
from stoker.shared import config as config_mod
from stoker.shared.config import DataConfig, FeaturesConfig, TextConfig
from stoker.shared.dataset.agreement import Reference, check_agreement, describe_copy, scan_dataset
from stoker.shared.dataset.corpus.registry import locate
from stoker.consumer.index.index import build_index
from stoker.shared.dataset.types import DatasetError
from stoker.shared.text import Characters, TextError, normalize
from stoker.shared.vocab import Vocabulary
from tests.speech import (make_english_digits_dataset, make_manifest_dataset, make_mixed_dataset,
                          make_persian_dataset, make_train_eval_dataset)

FEATURES = FeaturesConfig()


def _data(root: Path, **kw) -> DataConfig:
    return DataConfig(path=str(root), **{"index_cache": "off", **kw})


def test_persian_dataset_every_clip_with_its_own_tokens(tmp_path: Path) -> None:
    made = make_persian_dataset(tmp_path)
    index = build_index(_data(tmp_path), FEATURES, TextConfig(language="fa"))
    assert index.rejected == [] and {s.id for s in index.samples} == set(made)
    vocab = index.vocabulary
    for sample in index.samples:
        text = made[sample.id][0]
        assert sample.language == "fa" and sample.units == normalize(text, "fa")[0]
        assert vocab.decode(vocab.encode(sample.units)) == sample.units  # nothing lost on the way
    tokens = {tuple(vocab.encode(s.units).tolist()) for s in index.samples}
    assert len(tokens) == len({s.units for s in index.samples}) > 1  # different sentences, different tokens
    # the vocabulary is the Persian inventory (whatever the texts), which holds every character of theirs
    assert vocab.symbols[2:] == tuple(Characters().inventory(["fa"]))
    assert set("".join(s.units for s in index.samples)) < set(vocab.symbols)
    assert "\u0627" in vocab.symbols and index.lost == {"clips": 0, "chars": []}


def test_a_run_s_old_vocabulary_indexes_with_its_own_ids(tmp_path: Path) -> None:
    """A vocabulary saved when it was the texts' symbols alone (``--resume`` of such a run) keeps its ids."""
    make_persian_dataset(tmp_path)
    fresh = build_index(_data(tmp_path), FEATURES, TextConfig(language="fa"))
    seen = sorted(set("".join(s.units for s in fresh.samples)), reverse=True)  # another order than today's
    old = Vocabulary.from_state_dict({**fresh.vocabulary.state_dict(), "symbols": ["<pad>", "<eos>", *seen],
                                      "size": len(seen) + 2})
    index = build_index(_data(tmp_path), FEATURES, TextConfig(language="fa"), old)
    assert index.rejected == [] and index.vocabulary == old
    for sample in index.samples:
        assert old.encode(sample.units).tolist() == [2 + seen.index(ch) for ch in sample.units] + [1]


def test_english_digits_are_spelled_not_dropped(tmp_path: Path) -> None:
    made = make_english_digits_dataset(tmp_path)
    index = build_index(_data(tmp_path), FEATURES)
    assert index.rejected == [] and len(index.samples) == len(made)
    for sample in index.samples:
        assert not any(ch.isdigit() for ch in sample.units)
    with_digits = [s for s in index.samples if any(ch.isdigit() for ch in s.text)]
    assert with_digits, "the factory writes digits"
    spelled = build_index(_data(tmp_path), FEATURES, TextConfig(digits="keep"))
    kept = {s.id: s.units for s in spelled.samples}
    assert all(any(ch.isdigit() for ch in kept[s.id]) for s in with_digits)  # or kept as symbols


def test_mixed_dataset_languages_speakers_and_stable_ids(tmp_path: Path) -> None:
    made = make_mixed_dataset(tmp_path)
    index = build_index(_data(tmp_path), FEATURES)
    assert index.rejected == []
    vocab = index.vocabulary
    assert vocab.languages == ("en", "fa")
    assert vocab.speakers == tuple(sorted({speaker for _, speaker, _ in made.values()}))
    for sample in index.samples:
        _, speaker, language = made[sample.id]
        assert (sample.speaker, sample.language) == (speaker, language)
        assert vocab.speaker_id(speaker) == sorted(vocab.speakers).index(speaker)
    # the ids do not depend on the order of the metadata lines
    meta = tmp_path / "metadata.csv"
    lines = meta.read_text(encoding="utf-8").splitlines()
    meta.write_text("\n".join(reversed(lines)) + "\n", encoding="utf-8")
    again = build_index(_data(tmp_path), FEATURES).vocabulary
    assert again == vocab and again.fingerprint == vocab.fingerprint


def test_mixed_dataset_phonemes(tmp_path: Path) -> None:
    made = make_mixed_dataset(tmp_path)
    index = build_index(_data(tmp_path), FEATURES, TextConfig(frontend="phonemes"))
    assert index.rejected == [] and len(index.samples) == len(made)
    vocab = index.vocabulary
    assert vocab.frontend == "phonemes" and "ˈ" in vocab.symbols
    persian = [s for s in index.samples if s.language == "fa"]
    assert persian and not any("\u0600" <= ch <= "\u06ff" for s in persian for ch in s.units)  # IPA, not script
    cached = build_index(_data(tmp_path, index_cache=str(tmp_path / "cache")), FEATURES, TextConfig(frontend="phonemes"))
    warm = build_index(_data(tmp_path, index_cache=str(tmp_path / "cache")), FEATURES, TextConfig(frontend="phonemes"))
    assert (warm.stats.cache, warm.stats.texts_tokenized) == ("hit", 0) and cached.stats.texts_tokenized > 0
    assert [s.units for s in warm.samples] == [s.units for s in index.samples]  # the same units twice


def test_a_character_outside_the_vocabulary_is_counted_and_rejects_its_clip(tmp_path: Path) -> None:
    made = make_persian_dataset(tmp_path)
    first = next(iter(made))
    meta = tmp_path / "metadata.csv"
    text = made[first][0]
    meta.write_text(meta.read_text(encoding="utf-8").replace(f"{first}|{text}|{text}",
                                                             f"{first}|{text} \u263a|{text} \u263a"), encoding="utf-8")
    index = build_index(_data(tmp_path), FEATURES, TextConfig(language="fa"))
    assert [r.id for r in index.rejected] == [first] and index.rejected[0].kind == "lost-text"
    assert "U+263A" in index.rejected[0].reason and "text.max_lost_frac=0" in index.rejected[0].reason
    assert index.lost["clips"] == 1
    assert index.lost["chars"] == [{"char": "\u263a", "code": "U+263A", "name": "white smiling face", "count": 1,
                                    "clips": 1, "examples": [first]}]
    tolerant = build_index(_data(tmp_path), FEATURES, TextConfig(language="fa", max_lost_frac=0.5))
    assert tolerant.rejected == [] and tolerant.lost == index.lost  # kept, and still counted


def test_a_fixed_vocabulary_rejects_what_it_cannot_encode(tmp_path: Path) -> None:
    make_english_digits_dataset(tmp_path / "en")
    english = build_index(_data(tmp_path / "en"), FEATURES).vocabulary
    make_persian_dataset(tmp_path / "fa")
    with pytest.raises(DatasetError, match=r"clips were rejected because its language or speaker is not in the run's "
                                           r"tables.*language 'fa' is not in the run's tables"):
        build_index(_data(tmp_path / "fa"), FEATURES, TextConfig(language="fa"), english)


def test_most_clips_rejected_for_one_cause_is_one_line(tmp_path: Path) -> None:
    made = make_mixed_dataset(tmp_path)
    meta = tmp_path / "metadata.csv"
    meta.write_text(meta.read_text(encoding="utf-8").replace("|fa\n", "|farsi\n"), encoding="utf-8")
    persian = sum(1 for *_, language in made.values() if language == "fa")
    assert persian * 2 >= len(made)
    if persian * 2 == len(made):  # exactly half: one more clip in the unknown language makes it most
        meta.write_text(meta.read_text(encoding="utf-8").replace("|en\n", "|farsi\n", 1), encoding="utf-8")
    with pytest.raises(DatasetError, match=r"clips were rejected because its language is unknown: check the "
                                           r"language column \(data.columns\) or --language \(e.g. .*unknown "
                                           r"language code 'farsi'"):
        build_index(_data(tmp_path), FEATURES)


def test_manifest_layout(tmp_path: Path) -> None:
    made = make_manifest_dataset(tmp_path)
    index = build_index(_data(tmp_path, metadata_file="manifest.jsonl"), FEATURES)
    assert index.rejected == [] and {s.id for s in index.samples} == set(made)
    for sample in index.samples:
        text, speaker, language = made[sample.id]
        assert (sample.text, sample.speaker, sample.language) == (text, speaker, language)
        assert sample.audio.startswith("audio/") and (tmp_path / sample.audio).is_file()
    # a bad line is a counted rejection with its line number; the rest is used
    with open(tmp_path / "manifest.jsonl", "a", encoding="utf-8") as f:
        f.write("{not json\n")
        f.write(json.dumps({"audio_filepath": "audio/none.wav", "text": "gone"}) + "\n")
    index = build_index(_data(tmp_path, metadata_file="manifest.jsonl"), FEATURES)
    lines = len(made)
    assert [(r.line, r.reason.split(":")[0]) for r in index.rejected] == [
        (lines + 1, f"manifest line {lines + 1} is not JSON"), (lines + 2, "audio file missing")]
    assert index.rejected[1].file == "audio/none.wav"
    # a producer's copy of a manifest dataset agrees with the trainer's index
    assert check_agreement(Reference.of(index), describe_copy(tmp_path, "manifest.jsonl"), "other").ok
    assert scan_dataset(tmp_path, "manifest.jsonl").files[next(iter(made))].startswith("audio/")


def test_train_and_eval_files(tmp_path: Path) -> None:
    train, held = make_train_eval_dataset(tmp_path)
    cfg = config_mod.load(None, {"data.path": str(tmp_path), "data.metadata_file": "metadata_train.csv",
                                 "data.eval_file": "metadata_eval.csv", "data.index_cache": "off"})
    index = build_index(cfg.data, cfg.features, cfg.text)
    train_samples, val_samples, rejected = validation.hold_out(index, cfg, tmp_path)
    assert {s.id for s in train_samples} == set(train) and {s.id for s in val_samples} == set(held)
    assert rejected == []
    recorded = json.loads((tmp_path / validation.VALIDATION).read_text())
    assert recorded == {"source": "eval_file", "file": "metadata_eval.csv", "ids": [s.id for s in val_samples]}


def test_columns_mapping_and_agreement(tmp_path: Path) -> None:
    made = make_mixed_dataset(tmp_path)
    meta = tmp_path / "metadata.csv"
    rows = [line.split("|") for line in meta.read_text(encoding="utf-8").splitlines()]
    meta.write_text("\n".join(f"{r[0]}|{r[3]}|{r[4]}|{r[1]}" for r in rows) + "\n", encoding="utf-8")
    data = _data(tmp_path, columns="id|speaker|language|text")
    index = build_index(data, FEATURES)
    assert index.rejected == [] and {s.id: (s.speaker, s.language) for s in index.samples} == {
        i: (speaker, language) for i, (_, speaker, language) in made.items()}
    # a producer that read with the default mapping is told the trainer's
    verdict = check_agreement(Reference.of(index), describe_copy(tmp_path, "metadata.csv"), "hostb")
    assert not verdict.ok and verdict.columns == "id|speaker|language|text"
    assert check_agreement(Reference.of(index), describe_copy(tmp_path, "metadata.csv", verdict.columns), "hostb").ok


def test_bad_text_settings_are_one_line(tmp_path: Path) -> None:
    make_persian_dataset(tmp_path)
    with pytest.raises(TextError, match="cannot be imported"):
        build_index(_data(tmp_path), FEATURES, TextConfig(frontend="no_such_tokenizer_mod:encode"))
    with pytest.raises(config_mod.ConfigError, match="unknown language code 'xx'"):
        config_mod.load(None, {"text.language": "xx"})
    with pytest.raises(TextError, match="cannot keep the run's vocabulary: the run used the phonemes front-end"):
        fixed = Vocabulary.from_state_dict({**build_index(_data(tmp_path), FEATURES).vocabulary.state_dict(),
                                            "frontend": "phonemes"})
        build_index(_data(tmp_path), FEATURES, TextConfig(language="fa"), fixed)


MIX = """datasets:
  - path: fa
    language: fa
  - path: en
    name: english
  - path: man
    metadata_file: manifest.jsonl
"""


def test_several_datasets_mixed_in_one_run(tmp_path: Path) -> None:
    persian = make_persian_dataset(tmp_path / "fa", n=4)
    english = make_english_digits_dataset(tmp_path / "en", n=4)
    manifest = make_manifest_dataset(tmp_path / "man", n=4)
    (tmp_path / "mix.yaml").write_text(MIX, encoding="utf-8")
    data = _data(tmp_path / "mix.yaml", index_cache=str(tmp_path / "cache"))
    index = build_index(data, FEATURES)
    assert index.rejected == []
    expected = {**{f"fa:{i}": ("fa", "fa") for i in persian}, **{f"english:{i}": ("en", "english") for i in english},
                **{f"man:{i}": (language, speaker) for i, (_, speaker, language) in manifest.items()}}
    assert {s.id: (s.language, s.speaker) for s in index.samples} == expected  # each dataset's language and speaker
    by_id = index.by_id()
    assert by_id[f"fa:{next(iter(persian))}"].audio == f"fa/wavs/{next(iter(persian))}.wav"
    assert by_id[f"man:{next(iter(manifest))}"].audio == f"man/audio/{next(iter(manifest))}.wav"
    assert index.vocabulary.languages == ("en", "fa")
    assert build_index(data, FEATURES).stats.cache == "hit"
    # a producer host with its own copy (another directory) agrees with the trainer
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("fa", "en", "man"):
        (copy / name).symlink_to(tmp_path / name)
    (copy / "mix.yaml").write_text(MIX, encoding="utf-8")
    root, mix_file = locate(str(copy / "mix.yaml"), "metadata.csv").where
    assert check_agreement(Reference.of(index), describe_copy(root, mix_file), "hostb").ok
    # a missing clip is named with its dataset's path
    (tmp_path / "en" / "wavs" / f"{next(iter(english))}.wav").unlink()
    gone = build_index(data, FEATURES).rejected
    assert [(r.id, r.file) for r in gone] == [(f"english:{next(iter(english))}",
                                               f"en/wavs/{next(iter(english))}.wav")]


def test_a_mix_keeps_the_urls_and_absolute_paths_its_manifest_names_as_written(tmp_path: Path) -> None:
    made = make_manifest_dataset(tmp_path / "man", n=3)
    first, second, third = made
    absolute = str(tmp_path / "man" / "audio" / f"{first}.wav")
    url = f"s3://corpus/audio/{second}.wav"  # a duration given: the index asks the store nothing
    lines = (tmp_path / "man" / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    del rows[0]["duration"]  # an absolute path of this host, its header read there
    rows[0]["audio_filepath"], rows[1]["audio_filepath"] = absolute, url
    (tmp_path / "man" / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "mix.yaml").write_text("datasets:\n  - {path: man, metadata_file: manifest.jsonl}\n",
                                       encoding="utf-8")
    index = build_index(_data(tmp_path / "mix.yaml"), FEATURES)
    alone = build_index(_data(tmp_path / "man", metadata_file="manifest.jsonl"), FEATURES)
    assert index.rejected == [] and alone.rejected == []
    assert {s.id: s.audio for s in index.samples} == \
           {f"man:{first}": absolute, f"man:{second}": url, f"man:{third}": f"man/audio/{third}.wav"}
    assert [(s.text, s.num_frames, s.duration_s) for s in index.samples] == \
           [(s.text, s.num_frames, s.duration_s) for s in alone.samples]


@pytest.mark.parametrize(("mix", "message"), [
    ("datasets: []\n", "must hold one key, datasets"),
    ("datasets:\n  - path: nowhere\n", "nowhere is not a directory"),
    ("datasets:\n  - path: fa\n    langauge: fa\n", "unknown key 'langauge'"),
    ("datasets:\n  - path: fa\n  - path: fa\n", "names dataset 'fa' twice"),
    ("datasets:\n  - path: fa\n    language: 'f a'\n", "is not a language code"),
])
def test_a_bad_mix_file_is_one_line(tmp_path: Path, mix: str, message: str) -> None:
    make_persian_dataset(tmp_path / "fa", n=2)
    (tmp_path / "mix.yaml").write_text(mix, encoding="utf-8")
    with pytest.raises(DatasetError, match=message):
        build_index(_data(tmp_path / "mix.yaml"), FEATURES)
    with pytest.raises(DatasetError, match="mix file .* does not exist"):
        build_index(_data(tmp_path / "none.yaml"), FEATURES)


def test_a_user_tokenizer_indexes_and_sizes_the_vocabulary(tmp_path: Path) -> None:
    made = make_persian_dataset(tmp_path, n=4)
    text = TextConfig(frontend="tests.shared.user_tokenizers:bytes_tokenizer", language="fa")
    index = build_index(_data(tmp_path), FEATURES, text)
    vocab = index.vocabulary
    assert index.rejected == [] and vocab.is_user and vocab.size == 257
    for sample in index.samples:
        ids = vocab.encode(sample.units).tolist()
        assert ids == [b + 1 for b in made[sample.id][0].encode("utf-8")]  # the tokenizer's own ids
        assert sample.num_tokens == len(ids)
    with pytest.raises(TextError, match="returned 1.5"):
        build_index(_data(tmp_path), FEATURES, TextConfig(frontend="tests.shared.user_tokenizers:floats"))
