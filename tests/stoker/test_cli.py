"""The command line as a thin adapter over the run service: flags parsed into config keys,
the service's errors with the flag beside the key, the commands' own checks."""

from __future__ import annotations

from stoker.cli import KEY_FLAGS, build_parser, main, overrides, with_flags
from stoker.feed import OPTION_KEYS



def test_flags_are_parsed_into_the_config_keys_they_set_and_set_comes_last() -> None:
    args = build_parser().parse_args(["train", "--producers", "auto", "--data-gpu-memory", "512", "--steps", "5",
                                      "--set", "trainer.steps=7", "--set", "text.language=fa"])
    assert overrides(args) == {"pipeline.producers": "auto", "devices.data_gpu_memory_mb": 512, "trainer.steps": 7,
                               "text.language": "fa"}
    produce = build_parser().parse_args(["produce", "--connect", "tcp://h:1", "--data-gpu", "1"])
    assert overrides(produce) == {"data.path": "", "pipeline.producers": 1, "devices.data_gpu": 1,
                                  "run.log_level": "INFO"}


def test_the_command_line_and_the_feed_name_the_same_config_keys() -> None:
    """A flag of python run.py is a keyword option of stoker.Feed with the same key (but --model)."""
    assert set(KEY_FLAGS) == set(OPTION_KEYS.values()) | {"trainer.model"}
    assert {flag[2:].replace("-", "_") for key, flag in KEY_FLAGS.items() if key != "trainer.model"} == set(OPTION_KEYS)


def test_an_error_naming_a_config_key_gets_the_flag_beside_it() -> None:
    flags = {"pipeline.bind": "--bind", "pipeline.keys": "--keys", "connect": "--connect"}
    assert with_flags("pipeline.bind: x is reachable; set pipeline.keys, not pipeline.keys_x", flags,
                      suggests=("pipeline.keys",)) == \
        "pipeline.bind (--bind): x is reachable; set pipeline.keys (--keys), not pipeline.keys_x"
    assert with_flags("pipeline.bind: see pipeline.keys", flags) == "pipeline.bind (--bind): see pipeline.keys"
    assert with_flags("connect: not an endpoint", flags) == "--connect: not an endpoint"
    assert with_flags("run.run_dir: not empty", flags) == "run.run_dir: not empty"  # this command has no such flag
    assert with_flags("pipeline.bind is fine: see it", flags) == "pipeline.bind is fine: see it"


def test_a_service_error_reaches_the_command_line_with_its_key_and_flag(capsys, kept_logging) -> None:
    assert main(["--bind", "tcp://0.0.0.0:5555", "--steps", "1", "--model", "synthetic:1"]) == 2
    assert capsys.readouterr().err == (
        "stoker: error: pipeline.bind (--bind): tcp://0.0.0.0:5555 is reachable from other hosts; producers there "
        "would be unauthenticated: set pipeline.keys (--keys) to a keys directory (python run.py keys DIR), or "
        "pipeline.insecure (--insecure) to accept that\n")


def test_a_fresh_plan_without_resume_is_one_line(monkeypatch, capsys, kept_logging) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert main(["--fresh-plan", "--steps", "1"]) == 2
    assert capsys.readouterr().err == ("stoker: error: --fresh-plan starts a new epoch plan for a resumed run: give it "
                                       "with --resume RUN_DIR\n")
