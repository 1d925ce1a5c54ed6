"""Tests for shared/config.py: the schema, configs/default.yaml, overrides and validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from stoker.shared import config as config_mod
from stoker.shared.config import Config, ConfigError, from_dict, load, parse_override, save

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"

# Keys the documented command line (README.md) maps onto (flag -> section.key).
DOCUMENTED_KEYS = {
    "--data": "data.path", "--data-gpu": "devices.data_gpu", "--model-gpu": "devices.model_gpu",
    "--data-gpu-memory": "devices.data_gpu_memory_mb", "--model-gpu-memory": "devices.model_gpu_memory_mb",
    "--producers": "pipeline.producers", "--bind": "pipeline.bind", "--batch-size": "batching.batch_size",
    "--steps": "trainer.steps", "--epochs": "trainer.epochs", "--buffer-size": "pipeline.buffer_size",
    "--model-start-delay": "pipeline.model_start_delay_s", "--model": "trainer.model",
    "--run-dir": "run.run_dir", "--record-samples": "trainer.record_samples", "--keys": "pipeline.keys",
    "--insecure": "pipeline.insecure",
}


def _fields() -> list[tuple[str, str]]:
    return [(section, f.name) for section, cls in config_mod.SECTIONS.items() for f in dataclasses.fields(cls)]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- default.yaml

def test_default_yaml_is_where_the_defaults_come_from() -> None:
    assert load(DEFAULT_YAML) == Config()
    assert load(None) == Config()
    raw = yaml.safe_load(DEFAULT_YAML.read_text(encoding="utf-8"))
    assert Config().trainer.learning_rate == raw["trainer"]["learning_rate"]


def test_a_section_without_a_default_or_with_a_stray_key_is_refused_at_once() -> None:
    class Lacking:
        a: int
        b: str

    with pytest.raises(RuntimeError, match=r"section s: no default for \['b'\]; keys no setting has: \['c'\]"):
        config_mod.section("s", {"s": {"a": 1, "c": 2}})(Lacking)

    class Complete:
        a: int

    made = config_mod.section("s", {"s": {"a": 7}})(Complete)
    assert made().a == 7 and made(a=3).a == 3


def test_default_yaml_lists_every_field_and_nothing_else() -> None:
    raw = yaml.safe_load(DEFAULT_YAML.read_text(encoding="utf-8"))
    assert set(raw) == set(config_mod.SECTIONS)
    in_yaml = {(section, key) for section, keys in raw.items() for key in keys}
    assert in_yaml == set(_fields())


@pytest.mark.parametrize("flag", sorted(DOCUMENTED_KEYS))
def test_documented_keys_exist(flag: str) -> None:
    section, key = DOCUMENTED_KEYS[flag].split(".")
    assert (section, key) in _fields()
    assert f"\n  {key}:" in DEFAULT_YAML.read_text(encoding="utf-8")


def test_documented_defaults() -> None:
    cfg = Config()
    assert cfg.pipeline.buffer_size == 3
    assert cfg.pipeline.model_start_delay_s == 2.0
    assert cfg.data.path == ""
    assert cfg.trainer.model == "tiny"


# --------------------------------------------------------------------------- unknown keys

def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.buffer_sise"):
        from_dict({"pipeline": {"buffer_sise": 4}})


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.stepz"):
        load(_write(tmp_path, "trainer:\n  stepz: 10\n"))


def test_unknown_section_is_named() -> None:
    with pytest.raises(ConfigError, match="'optimizer'"):
        from_dict({"optimizer": {"lr": 1.0}})


def test_unknown_override_section_and_key() -> None:
    with pytest.raises(ConfigError, match="'optimizer'"):
        load(None, {"optimizer.lr": 1.0})
    with pytest.raises(ConfigError, match=r"batching\.bucket_count"):
        load(None, {"batching.bucket_count": 2})
    with pytest.raises(ConfigError, match="section.key"):
        load(None, {"batch_size": 2})
    with pytest.raises(ConfigError, match="section.key"):
        load(None, {"a.b.c": 2})


def test_section_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="'data'"):
        from_dict({"data": [1, 2]})
    with pytest.raises(ConfigError, match="mapping"):
        from_dict([1, 2])  # type: ignore[arg-type]


def test_empty_section_is_allowed_and_accepts_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices:\ntrainer:\n  steps: 5\n")
    assert load(path).devices == Config().devices
    assert load(path, {"devices.data_gpu": 1}).devices.data_gpu == 1


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(_write(tmp_path, "data: [unclosed\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load(_write(tmp_path, "- a\n- b\n"))
    assert load(_write(tmp_path, "")) == Config()


# --------------------------------------------------------------------------- types

@pytest.mark.parametrize(("key", "value"), [
    ("batching.batch_size", "16"),  # string for int
    ("batching.batch_size", 16.0),  # float for int
    ("batching.batch_size", 16.5),
    ("batching.batch_size", True),  # bool for int
    ("batching.batch_size", None),  # None where not Optional
    ("features.fmax_hz", "8000"),  # string for float
    ("features.fmax_hz", True),  # bool for float
    ("features.fmax_hz", None),
    ("pipeline.insecure", 1),  # int for bool
    ("pipeline.insecure", "true"),
    ("trainer.model", 5),  # int for str
    ("trainer.model", None),
    ("devices.data_gpu", True),  # bool for Optional[int]
    ("devices.data_gpu", "0"),
    ("devices.data_gpu", 1.0),
    ("trainer.steps", [1]),
])
def test_wrong_types(key: str, value) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(None, {key: value})


def test_int_accepted_for_float() -> None:
    cfg = load(None, {"features.fmax_hz": 7000, "pipeline.heartbeat_timeout_s": 10})
    assert cfg.features.fmax_hz == 7000.0 and isinstance(cfg.features.fmax_hz, float)
    assert isinstance(cfg.pipeline.heartbeat_timeout_s, float)


def test_none_where_optional() -> None:
    cfg = load(None, {"devices.data_gpu": None, "trainer.steps": None, "trainer.epochs": 2})
    assert cfg.devices.data_gpu is None and cfg.trainer.steps is None and cfg.trainer.epochs == 2
    assert load(None, {"devices.model_gpu": 1}).devices.model_gpu == 1


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().batching.batch_size = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- --set

@pytest.mark.parametrize(("text", "expected"), [
    ("batching.batch_size=32", ("batching.batch_size", 32)),
    ("features.fmax_hz=7600.5", ("features.fmax_hz", 7600.5)),
    ("features.log_floor=1e-5", ("features.log_floor", 1e-5)),
    ("features.log_floor=1.0e-5", ("features.log_floor", 1e-5)),
    ("features.fmax_hz=7.6E3", ("features.fmax_hz", 7600.0)),
    ("pipeline.insecure=true", ("pipeline.insecure", True)),
    ("pipeline.insecure=false", ("pipeline.insecure", False)),
    ("devices.data_gpu=null", ("devices.data_gpu", None)),
    ("devices.data_gpu=~", ("devices.data_gpu", None)),
    ("trainer.model=synthetic:20", ("trainer.model", "synthetic:20")),
    ("pipeline.bind=tcp://0.0.0.0:5555", ("pipeline.bind", "tcp://0.0.0.0:5555")),
    ("run.run_dir=", ("run.run_dir", "")),
    ("run.run_dir=a=b", ("run.run_dir", "a=b")),
    (" trainer.steps = 7", ("trainer.steps", 7)),
    ("trainer.model=[unclosed", ("trainer.model", "[unclosed")),  # not YAML: kept as text
])
def test_parse_override(text: str, expected) -> None:
    key, value = parse_override(text)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


@pytest.mark.parametrize("text", ["batching.batch_size", "=5", "  =5", ""])
def test_parse_override_malformed(text: str) -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override(text)


def test_override_wins_over_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "batching:\n  batch_size: 8\n")
    assert load(path).batching.batch_size == 8
    key, value = parse_override("batching.batch_size=4")
    assert load(path, {key: value}).batching.batch_size == 4
    key, value = parse_override("features.log_floor=1e-4")
    assert load(path, {key: value}).features.log_floor == pytest.approx(1e-4)


def test_parsed_string_for_int_is_refused() -> None:
    key, value = parse_override("batching.batch_size=many")
    with pytest.raises(ConfigError, match=r"batching\.batch_size"):
        load(None, {key: value})


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize(("overrides", "match"), [
    ({"features.win_length": 2048}, "win_length"),
    ({"features.fmax_hz": 11026.0}, "fmax_hz"),
    ({"features.fmin_hz": 9000.0}, "fmin_hz"),
    ({"features.fmin_hz": -1.0}, "fmin_hz"),
    ({"pipeline.heartbeat_timeout_s": 1.0}, "heartbeat_timeout_s"),
    ({"pipeline.heartbeat_timeout_s": 0.5}, "heartbeat_timeout_s"),
    ({"trainer.steps": None, "trainer.epochs": None}, "trainer.steps or trainer.epochs"),
    ({"trainer.steps": 0}, "trainer.steps"),
    ({"trainer.epochs": -1}, "trainer.epochs"),
    ({"batching.batch_size": 0}, "batching.batch_size"),
    ({"pipeline.buffer_size": 0}, "pipeline.buffer_size"),
    ({"features.hop_length": -256}, "features.hop_length"),
    ({"features.log_floor": 0}, "log_floor"),
    ({"features.backend": "torch"}, "backend"),
    ({"pipeline.producers": -1}, "producers"),
    ({"data.min_audio_s": 5.0, "data.max_audio_s": 1.0}, "min_audio_s"),
    ({"data.min_audio_s": 0}, "min_audio_s"),
    ({"devices.data_gpu": -1}, "devices.data_gpu"),
    ({"devices.model_gpu_memory_mb": -5}, "devices.model_gpu_memory_mb"),
    ({"run.log_level": "LOUD"}, "log_level"),
    ({"transforms.models": "enc:codes"}, "transforms.models and transforms.model_fields go together"),
    ({"transforms.models": "enc", "transforms.model_fields": "c:int32:T/4:-1"}, "'enc' is not package.module:function"),
    ({"transforms.models": "m:f", "transforms.model_fields": "mel:float32:T:0"}, "'mel' is not a new identifier"),
    ({"transforms.models": "m:f", "transforms.model_fields": "c:int32:T/0:0"}, "dimensions 'T/0'"),
    ({"transforms.models": "m:f", "transforms.model_fields": "c:int64:T:0"}, "dtype one of float32, int32"),
])
def test_cross_field_validation(overrides, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(None, overrides)


def test_valid_edges_pass() -> None:
    cfg = load(None, {"features.win_length": 1024, "features.n_fft": 1024, "features.fmax_hz": 11025.0,
                      "pipeline.heartbeat_timeout_s": 1.01, "trainer.steps": None, "trainer.epochs": 1,
                      "pipeline.producers": 0, "run.log_level": "debug", "devices.data_gpu": 0})
    assert cfg.features.fmax_hz == 11025.0
    assert cfg.trainer.epochs == 1 and cfg.pipeline.producers == 0
    # fmax must follow the sample rate: 8000 is above the Nyquist frequency of 12 kHz audio.
    with pytest.raises(ConfigError, match="fmax_hz"):
        load(None, {"features.sample_rate_hz": 12000})


# --------------------------------------------------------------------------- save / load

def test_save_then_load_round_trip(tmp_path: Path) -> None:
    cfg = load(None, {
        "data.path": "/some/where", "features.log_floor": 1e-7, "features.fmax_hz": 7600.0,
        "batching.batch_size": 5, "pipeline.bind": "tcp://127.0.0.1:5555", "pipeline.insecure": True,
        "devices.data_gpu": 0, "devices.model_gpu": 1, "devices.data_gpu_memory_mb": 1024,
        "trainer.steps": None, "trainer.epochs": 3, "trainer.model": "synthetic:15", "run.log_level": "DEBUG",
    })
    path = tmp_path / "config.yaml"
    save(cfg, path)
    again = load(path)
    assert again == cfg
    assert again.features.log_floor == 1e-7
    assert yaml.safe_load(path.read_text(encoding="utf-8"))["devices"]["model_gpu"] == 1


def test_save_default_round_trip(tmp_path: Path) -> None:
    save(Config(), tmp_path / "c.yaml")
    assert load(tmp_path / "c.yaml") == Config()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("text.language", "xx", "unknown language code 'xx' for text.language"),
    ("text.frontend", "bad", "text.frontend must be characters, phonemes or package.module:function"),
    ("text.digits", "words", "text.digits must be 'spell' or 'keep'"),
    ("text.max_lost_frac", 1.5, "text.max_lost_frac must be between 0 and 1"),
    ("data.columns", "id|txt", "unknown column 'txt'"),
    ("batching.fields", "speaker", "batching.fields: unknown batch field 'speaker'"),
])
def test_text_layout_and_field_settings_are_checked(key: str, value: object, message: str) -> None:
    with pytest.raises(config_mod.ConfigError, match=message):
        config_mod.load(None, {key: value})


def test_rows_are_fixed_where_batches_split_and_fixed_rows_switch_row_mask_on() -> None:
    """Replicas or trainer workers fix the rows (each batch splits into equal parts); fixed rows
    bring the row_mask field, once, after the fields the run switches on."""
    cfg = config_mod.load(None, {"batching.fields": "speaker_id"})
    assert not cfg.batching.fixed_rows and config_mod.with_fixed_rows(cfg) is cfg
    assert "row_mask" not in config_mod.batch_schema(cfg).names
    for fixed in (config_mod.with_fixed_rows(cfg, workers=2),
                  config_mod.with_fixed_rows(dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices,
                                                                                                 replicas=2))),
                  config_mod.load(None, {"batching.fields": "speaker_id", "batching.fixed_rows": True})):
        assert fixed.batching.fixed_rows and config_mod.batch_fields(fixed) == "speaker_id,row_mask"
        assert config_mod.batch_schema(fixed).names[-2:] == ("speaker_id", "row_mask")
    asked = config_mod.load(None, {"batching.fields": "row_mask", "batching.fixed_rows": True})
    assert config_mod.batch_fields(asked) == "row_mask"  # switched on by hand too: still once


def test_max_message_bytes_is_the_megabytes_setting_in_bytes() -> None:
    """The sockets' frame limit and the plan's wire check read the one conversion."""
    assert load(None, {"pipeline.max_message_mb": 3}).pipeline.max_message_bytes == 3 * 1024 * 1024
