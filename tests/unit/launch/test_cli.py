"""Tests for the command line: parse_args in-process, `python -m grpo_flyte.driver` in subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_flyte
from grpo_flyte.config.errors import make_config
from grpo_flyte.config.run import RunConfig, leaf_fields
from grpo_flyte.engine.prompts import tokenize_prompt
from grpo_flyte.errors import ConfigError, UserError
from grpo_flyte.launch.cli import parse_args, user_message
from tests.support import warm_python

# --------------------------------------------------------------------------- parse_args


def test_flags_map_to_fields():
    options, config, explicit = parse_args(
        [
            "--local",
            "--run-dir", "out/run1",
            "--model", "/models/tiny",
            "--dataset", "train.jsonl",
            "--iterations", "7",
            "--prompts-per-iter", "3",
            "--group-size", "5",
            "--max-new-tokens", "64",
            "--temperature", "0.7",
            "--learning-rate", "0.002",
            "--lora-rank", "4",
            "--seed", "42",
            "--backend", "hf",
            "--prompt-format", "plain",
        ]
    )  # fmt: skip
    assert options == {"local": True, "run_dir": Path("out/run1"), "resume": False, "resume_run": None, "config": None, "sweep": []}
    assert config.flat()["model"] == "/models/tiny"
    assert config.flat()["dataset"] == "train.jsonl"
    assert config.iterations == 7
    assert config.prompts_per_iter == 3
    assert config.flat()["group_size"] == 5
    assert config.flat()["max_new_tokens"] == 64
    assert config.flat()["temperature"] == 0.7
    assert config.flat()["learning_rate"] == 0.002
    assert config.flat()["lora_rank"] == 4
    assert config.seed == 42
    assert config.flat()["backend"] == "hf"
    assert config.flat()["prompt_format"] == "plain"
    assert explicit == {
        "model", "dataset", "iterations", "prompts_per_iter", "group_size", "max_new_tokens",
        "temperature", "learning_rate", "lora_rank", "seed", "backend", "prompt_format",
    }  # fmt: skip
    # everything not given keeps its default
    assert config.flat()["top_p"] == RunConfig().sampling.top_p
    assert config.flat()["lora_alpha"] == RunConfig().lora.lora_alpha


def test_objective_flags_map_to_fields():
    _, config, explicit = parse_args(
        [
            "--loss-type", "dapo", "--epsilon", "0.1", "--epsilon-high", "0.28", "--updates-per-iter", "2",
            "--beta", "0.04", "--no-is-correction", "--is-cap", "3", "--truncated", "mask",
            "--min-informative-groups", "3", "--max-topup-rounds", "1", "--eval-every", "5", "--eval-size", "50",
        ]
    )  # fmt: skip
    assert (config.flat()["loss_type"], config.flat()["epsilon"], config.flat()["epsilon_high"], config.flat()["updates_per_iter"]) == (
        "dapo",
        0.1,
        0.28,
        2,
    )
    assert (config.flat()["beta"], config.flat()["is_correction"], config.flat()["is_cap"], config.flat()["truncated"]) == (
        0.04,
        False,
        3.0,
        "mask",
    )
    assert (config.min_informative_groups, config.max_topup_rounds) == (3, 1)
    assert (config.flat()["eval_every"], config.flat()["eval_size"]) == (5, 50)
    assert "is_correction" in explicit and "truncated" in explicit


def test_no_flags_gives_defaults():
    options, config, explicit = parse_args([])
    assert options == {"local": False, "run_dir": None, "resume": False, "resume_run": None, "config": None, "sweep": []}
    assert config == RunConfig()
    assert explicit == set()


def test_explicit_contains_only_given_flags():
    options, config, explicit = parse_args(["--local", "--resume", "--run-dir", "d", "--iterations", "20"])
    # run options are not config fields
    assert explicit == {"iterations"}
    assert options["resume"] is True and options["local"] is True
    assert config.iterations == 20


def test_flag_equal_to_default_is_still_explicit():
    _, _config, explicit = parse_args(["--seed", str(RunConfig().seed)])
    assert explicit == {"seed"}


def test_config_file_values_overridden_by_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("seed: 5\ngroup_size: 3\nlearning_rate: 0.01\nprompt_format: plain\n")
    default_seed = RunConfig().seed
    options, config, explicit = parse_args(["--config", str(cfg), "--group-size", "8", "--seed", str(default_seed)])
    assert options["config"] == cfg
    assert config.flat()["group_size"] == 8  # flag beats the file
    assert config.seed == default_seed  # a flag equal to the default still beats the file
    assert config.flat()["learning_rate"] == 0.01  # file beats the default
    assert config.flat()["prompt_format"] == "plain"
    # given: by a flag or in the file (a --resume compares each with the saved config, never ignores one)
    assert explicit == {"group_size", "seed", "learning_rate", "prompt_format"}


def test_json_config_file(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"iterations": 2, "lora_target_modules": ["q_proj"]}))
    _, config, explicit = parse_args(["--config", str(cfg)])
    assert config.iterations == 2
    assert config.flat()["lora_target_modules"] == ("q_proj",)
    assert explicit == {"iterations", "lora_target_modules"}  # given in the file


def test_bad_value_in_config_file_is_a_config_error(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("group_size: 1\n")
    with pytest.raises(ConfigError, match="--group-size"):
        parse_args(["--config", str(cfg)])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus_key: 1\n", r"run.yaml': unknown key 'bogus_key'; see --help"),
        ("lerning_rate: 0.1\n", r"run.yaml': unknown key 'lerning_rate'; did you mean 'learning_rate'\?"),
        ("train:\n  lerning_rate: 0.1\n", r"run.yaml': unknown key 'train.lerning_rate'; did you mean 'learning_rate'\?"),
    ],
)
def test_unknown_key_in_config_file_names_the_file_and_the_key(tmp_path, text, message):
    """Not an unknown command-line option: the user typed no such flag."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        parse_args(["--config", str(cfg)])
    assert "unknown option" not in user_message(info.value) and "--lerning" not in user_message(info.value)


def test_unknown_flag_is_named():
    with pytest.raises(UserError) as exc:
        parse_args(["--bogus-flag"])
    assert "--bogus-flag" in str(exc.value)


def test_non_integer_value_names_the_flag():
    with pytest.raises(UserError) as exc:
        parse_args(["--group-size", "abc"])
    assert "--group-size" in str(exc.value)
    assert "abc" in str(exc.value)


def test_missing_value_names_the_flag():
    with pytest.raises(UserError, match="--group-size"):
        parse_args(["--group-size"])


def test_out_of_range_flag_is_a_config_error():
    with pytest.raises(ConfigError) as exc:
        parse_args(["--group-size", "1"])
    assert re.search(r"--group-size\W+1\b", str(exc.value))


def test_environment_variables_do_not_leak_into_config(monkeypatch):
    monkeypatch.setenv("SEED", "9")
    monkeypatch.setenv("GROUP_SIZE", "3")
    monkeypatch.setenv("MODEL", "/elsewhere")
    monkeypatch.setenv("LOCAL", "true")
    options, config, explicit = parse_args([])
    assert config == RunConfig()
    assert options["local"] is False
    assert explicit == set()


# --------------------------------------------------------------------------- subprocess: --help

HELP_FLAGS = [
    "--local", "--run-dir", "--resume", "--config", "--model", "--dataset", "--iterations",
    "--prompts-per-iter", "--group-size", "--max-new-tokens", "--temperature", "--learning-rate",
    "--lora-rank", "--seed", "--backend",
]  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GRPO_FLYTE_CACHE"] = str(tmp_path / "grpo-cache")  # must never be created on these paths
    env["COLUMNS"] = "100"
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def help_text(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("help")
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_flyte.driver", "--help"],
        capture_output=True, text=True, cwd=tmp, env=_env(tmp), timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp.iterdir()) == []
    return proc.stdout


def _option_blocks(help_text: str) -> dict[str, str]:
    """Flag -> its help block (whitespace collapsed) from the 'options:' section."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.split("options:", 1)[1].splitlines():
        m = re.match(r"^  (--[a-z0-9-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line
        elif current:
            blocks[current] += " " + line
    return {k: " ".join(v.split()) for k, v in blocks.items()}


def test_help_lists_the_flags(help_text):
    assert help_text.startswith("usage: python -m grpo_flyte.driver")
    blocks = _option_blocks(help_text)
    for f in HELP_FLAGS:
        assert f in blocks, f


def test_help_says_what_memory_a_long_episode_needs(help_text):
    """A tool that returns a web page puts thousands of tokens into an episode: --help says how its
    memory grows, generating (the key/value cache a token) and training (checkpointed past the budget)."""
    blocks = _option_blocks(help_text)
    assert "23 KB on the embedded model in bfloat16" in blocks["--max-episode-tokens"]
    assert "not their square" in blocks["--max-episode-tokens"]
    assert "one longer than this trains alone with gradient checkpointing" in blocks["--micro-batch-tokens"]
    assert "Always on for a sequence longer than micro_batch_tokens" in blocks["--gradient-checkpointing"]


def test_help_has_every_config_field_with_default(help_text):
    blocks = _option_blocks(help_text)
    for name, field in leaf_fields():
        f = "--" + name.replace("_", "-")
        assert f in blocks, f"{name} has no flag {f}"
        block = blocks[f]
        default = field.get_default(call_default_factory=True)
        if default is None:  # unset: nothing to show
            assert "(default:" not in block, (f, block)
        elif isinstance(default, (dict, tuple)):
            shown = ",".join(f"{k}={v}" for k, v in default.items()) if isinstance(default, dict) else ",".join(default)
            assert f"(default: {shown})" in block, (f, block)
        elif "default" not in field.description:
            assert f"(default: {default})" in block, (f, block)
        # the description (single source of help text) is shown; compare its first words
        first_words = " ".join(field.description.split()[:3])
        assert first_words in block, (f, block)


# --------------------------------------------------------------------------- subprocess: bad input


def _make_bad_jsonl(d: Path) -> None:
    (d / "bad.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": oops}\n')


def _make_empty_dir(d: Path) -> None:
    (d / "D").mkdir()


def _make_existing_run(d: Path) -> None:
    (d / "D").mkdir()
    (d / "D" / "config.json").write_text(RunConfig().model_dump_json())


def _make_file_run_dir(d: Path) -> None:
    (d / "D").write_text("not a folder")


def _make_small_jsonl(d: Path) -> None:
    (d / "small.jsonl").write_text("".join(f'{{"question": "What is {i} + 1?", "answer": {i + 1}}}\n' for i in range(3)))


def _make_unanswered_jsonl(d: Path) -> None:
    (d / "poems.jsonl").write_text("".join(json.dumps({"question": f"A poem about {w}."}) + "\n" for w in ("rain", "sun", "snow", "wind")))


def _make_bad_gsm8k(d: Path) -> None:
    good = {"question": "Tom has 3 pens and buys 2. How many now?", "answer": "3+2=<<3+2=5>>5\n#### 5"}
    bad = {"question": "Sue has 4 cats. How many legs?", "answer": "Each cat has 4 legs, so 16 legs.\n#### "}
    (d / "gsm.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + json.dumps(bad) + "\n")


def _make_csvs(d: Path) -> None:
    (d / "cols.csv").write_text("q,a\nWhat is 1 + 1?,2\n")
    (d / "rows.csv").write_text("question,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,\n")


def _make_bad_yaml(d: Path) -> None:
    (d / "bad.yaml").write_text("group_size: [3\n")


# (id, argv, setup, words the one-line message must contain); run as `python -m grpo_flyte.driver`
BAD_INPUT = [
    ("group-size-1", ["--local", "--group-size", "1", "--run-dir", "D"], None, ["--group-size", "1"]),
    ("missing-dataset", ["--local", "--dataset", "missing.jsonl", "--run-dir", "D"], None, ["--dataset 'missing.jsonl'", "no such file"]),
    ("bad-jsonl", ["--local", "--dataset", "bad.jsonl"], _make_bad_jsonl, ["--dataset 'bad.jsonl' line 2"]),
    ("bogus-flag", ["--local", "--bogus-flag"], None, ["--bogus-flag"]),
    ("no-model-dir", ["--local", "--model", "/no/such/dir", "--run-dir", "D"], None, ["--model '/no/such/dir'"]),
    ("resume-no-run-dir", ["--local", "--resume"], None, ["--resume", "--run-dir"]),
    ("resume-no-config", ["--local", "--resume", "--run-dir", "D"], _make_empty_dir, ["config.json"]),
]
# more bad input, checked in-process through cli.main (same code path, no interpreter start-up)
BAD_INPUT_IN_PROCESS = [
    ("group-size-abc", ["--local", "--group-size", "abc", "--run-dir", "D"], None, ["--group-size", "abc"]),
    ("run-dir-holds-run", ["--local", "--run-dir", "D"], _make_existing_run, ["--run-dir", "--resume"]),
    ("run-dir-is-file", ["--local", "--run-dir", "D"], _make_file_run_dir, ["--run-dir", "file"]),
    ("run-dir-without-local", ["--run-dir", "D"], None, ["--local"]),
    ("resume-changed-config", ["--local", "--resume", "--run-dir", "D", "--seed", "99"], _make_existing_run, ["--seed"]),
    ("dataset-csv", ["--local", "--dataset", "x.csv", "--run-dir", "D"], None, ["--dataset 'x.csv'"]),
    ("eval-size-above-held-out", ["--local", "--eval-size", "501", "--run-dir", "D"], None, ["--eval-size 501", "500"]),
    (
        "eval-size-vs-small-file",
        ["--local", "--dataset", "small.jsonl", "--eval-size", "3", "--run-dir", "D"],
        _make_small_jsonl,
        ["--eval-size 3", "small.jsonl", "3 examples"],
    ),
    ("loss-type", ["--local", "--loss-type", "ppo", "--run-dir", "D"], None, ["--loss-type", "ppo"]),
    ("epsilon-zero", ["--local", "--epsilon", "0", "--run-dir", "D"], None, ["--epsilon=0.0"]),
    (
        "gsm8k-row-without-answer",
        ["--local", "--dataset", "gsm.jsonl", "--eval-size", "0", "--run-dir", "D"],
        _make_bad_gsm8k,
        ["--dataset 'gsm.jsonl' line 3", "no usable answer in 'answer'"],
    ),
    (
        "csv-missing-column",
        ["--local", "--dataset", "cols.csv", "--run-dir", "D"],
        _make_csvs,
        ["--dataset 'cols.csv'", "no column 'question' (columns: q, a)", "question_column"],
    ),
    (
        "csv-row-without-answer",
        ["--local", "--dataset", "rows.csv", "--run-dir", "D"],
        _make_csvs,
        ["--dataset 'rows.csv' row 2", "no usable answer"],
    ),
    (
        "reward-unknown-name",
        ["--local", "--rewards", "corect=1", "--run-dir", "D"],
        None,
        ["--rewards", "unknown reward 'corect'", "module:function"],
    ),
    (
        "reward-module-missing",
        ["--local", "--rewards", "correct=1,no_such_mod:judge=0.5", "--run-dir", "D"],
        None,
        ["--rewards 'no_such_mod:judge'", "cannot import module 'no_such_mod'"],
    ),
    ("reward-weight-not-a-number", ["--local", "--rewards", "correct=high", "--run-dir", "D"], None, ["--rewards", "high"]),
    # errors about two options together name both flags, as an error about one does
    (
        "train-processes-vs-rollouts-per-step",
        ["--local", "--train-processes", "64", "--prompts-per-iter", "2", "--group-size", "2", "--run-dir", "D"],
        None,
        ["--train-processes=64 with 4 rollouts per optimizer step (--prompts-per-iter=2 x --group-size=2 / --updates-per-iter=1)"],
    ),
    (
        "adapters-to-keep-vs-staleness",
        ["--local", "--adapters-to-keep", "2", "--max-staleness", "2", "--run-dir", "D"],
        None,
        ["--adapters-to-keep=2 with --max-staleness=2: expected at least 3"],
    ),
    (
        "adapter-cache-vs-staleness",
        ["--local", "--adapter-cache-size", "2", "--max-staleness", "1", "--run-dir", "D"],
        None,
        ["--adapter-cache-size=2 with --max-staleness=1: expected at least 3"],
    ),
    (
        "embeddings-without-4bit",
        ["--local", "--embeddings-in-4bit", "--run-dir", "D"],
        None,
        ["error: --embeddings-in-4bit needs --load-in-4bit"],
    ),
    (
        "judge-without-model",
        ["--local", "--rewards", "judge=1", "--run-dir", "D"],
        None,
        ["--rewards names 'judge' but --judge-model is not set"],
    ),
    # the guard's options
    ("on-collapse-unknown", ["--local", "--on-collapse", "panic", "--run-dir", "D"], None, ["--on-collapse='panic'", "rollback"]),
    ("rollback-lr-factor-zero", ["--local", "--rollback-lr-factor", "0", "--run-dir", "D"], None, ["--rollback-lr-factor=0"]),
    ("rollback-lr-factor-above-1", ["--local", "--rollback-lr-factor", "2", "--run-dir", "D"], None, ["--rollback-lr-factor=2"]),
    ("max-rollbacks-negative", ["--local", "--max-rollbacks", "-1", "--run-dir", "D"], None, ["--max-rollbacks=-1"]),
    ("select-by-unknown", ["--local", "--select-by", "loss", "--run-dir", "D"], None, ["--select-by='loss'", "eval_accuracy"]),
    ("export-adapter-unknown", ["--local", "--export-adapter", "last", "--run-dir", "D"], None, ["--export-adapter='last'", "final"]),
    (
        "patience-without-evaluations",
        ["--local", "--early-stop-patience", "2", "--eval-size", "0", "--run-dir", "D"],
        None,
        ["--early-stop-patience=2 with --eval-size=0: patience counts held-out evaluations"],
    ),
    (
        "select-by-accuracy-without-answers",
        [
            "--local",
            "--dataset",
            "poems.jsonl",
            "--rewards",
            "format=1",
            "--select-by",
            "eval_accuracy",
            "--eval-size",
            "2",
            "--run-dir",
            "D",
        ],
        _make_unanswered_jsonl,
        ["--select-by eval_accuracy: 2 of the 2 held-out questions have no gold answer", "--select-by eval_reward"],
    ),
]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    """Launch every bad-input command at once (they are independent) and collect the results."""
    procs = {}
    for case_id, argv, setup, _ in BAD_INPUT:
        cwd = tmp_path_factory.mktemp(case_id)
        if setup:
            setup(cwd)
        before = _snapshot(cwd)
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_flyte.driver", *argv],
            cwd=cwd, env=_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs[case_id] = (proc, cwd, before)
    results = {}
    for case_id, (proc, cwd, before) in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[case_id] = (proc.returncode, out, err, cwd, before)
    return results


def _check_bad_input(result, words):
    rc, out, err, cwd, before = result
    assert "Traceback" not in err and "Traceback" not in out, err
    assert rc == 2, (rc, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:"), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    # nothing created or changed: no run dir, no ./runs/<time>, no model conversion in the cache
    assert _snapshot(cwd) == before
    assert not (cwd / "grpo-cache").exists()


@pytest.mark.parametrize(("case_id", "argv", "setup", "words"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_exits_2_with_one_line(bad_input_results, case_id, argv, setup, words):
    _check_bad_input(bad_input_results[case_id], words)


def _main_in(tmp_path, monkeypatch, capsys, argv, setup):
    from grpo_flyte.launch.cli import main

    if setup:
        setup(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPO_FLYTE_CACHE", str(tmp_path / "grpo-cache"))
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, tmp_path, before


@pytest.mark.parametrize(("case_id", "argv", "setup", "words"), BAD_INPUT_IN_PROCESS, ids=[c[0] for c in BAD_INPUT_IN_PROCESS])
def test_bad_input_in_process(tmp_path, monkeypatch, capsys, case_id, argv, setup, words):
    _check_bad_input(_main_in(tmp_path, monkeypatch, capsys, argv, setup), words)


def test_bad_yaml_config_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    argv = ["--local", "--config", "bad.yaml", "--run-dir", "D"]
    _check_bad_input(_main_in(tmp_path, monkeypatch, capsys, argv, _make_bad_yaml), ["bad.yaml"])


def test_bad_yaml_config_exits_2_without_writing(tmp_path, monkeypatch, capsys):
    # the parts of the contract that do hold for an invalid YAML file
    argv = ["--local", "--config", "bad.yaml", "--run-dir", "D"]
    rc, _out, err, cwd, before = _main_in(tmp_path, monkeypatch, capsys, argv, _make_bad_yaml)
    assert rc == 2
    assert err.startswith("error: --config") and "bad.yaml" in err
    assert _snapshot(cwd) == before


def _make_stale_run(d: Path) -> None:
    # config.json of an earlier run that no longer validates (hand-edited, or a renamed field)
    (d / "D").mkdir()
    (d / "D" / "config.json").write_text('{"group_size": 6, "old_field": 1}')


def test_resume_with_invalid_saved_config_is_a_user_error(tmp_path, monkeypatch, capsys):
    argv = ["--local", "--resume", "--run-dir", "D"]
    result = _main_in(tmp_path, monkeypatch, capsys, argv, _make_stale_run)
    _check_bad_input(result, ["config.json"])


def test_library_error_names_the_field_and_the_cli_names_the_flag(tmp_path, monkeypatch, capsys):
    # The library speaks in config fields (a Python API user sets `dataset`), the CLI in flags.
    from grpo_flyte.data import load_file
    from grpo_flyte.errors import DatasetError, GrpoFlyteError
    from grpo_flyte.launch.cli import user_message

    with pytest.raises(DatasetError) as info:
        load_file(tmp_path / "missing.jsonl")
    exc = info.value
    assert isinstance(exc, GrpoFlyteError)
    assert exc.field == "dataset"
    assert str(exc).startswith("dataset '"), str(exc)
    assert str(exc) == f"dataset {exc.detail}"
    assert "missing.jsonl" in str(exc) and "no such file" in str(exc)
    assert user_message(exc) == f"--dataset {exc.detail}"

    argv = ["--local", "--dataset", "missing.jsonl", "--run-dir", "D"]
    rc, _out, err, cwd, before = _main_in(tmp_path, monkeypatch, capsys, argv, None)
    assert rc == 2
    assert err.startswith("error: --dataset 'missing.jsonl': no such file"), err
    assert "error: dataset" not in err
    assert _snapshot(cwd) == before


def test_without_local_and_without_a_cluster_config_the_cli_stops_instead_of_training_here(tmp_path, monkeypatch, capsys):
    import flyte

    from grpo_flyte.launch import cli
    from grpo_flyte.runtime.cache import cache_root

    for var in ("FLYTECTL_CONFIG", "UCTL_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    # the models are checked before the cluster: the cache stays where the embedded model is converted
    # already (under a new HOME the conversion runs again, 30 s)
    monkeypatch.setenv("GRPO_FLYTE_CACHE", str(cache_root()))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.flyte or ~/.union config
    monkeypatch.chdir(tmp_path)  # no ./.flyte/config.yaml (and no git root holding one)
    submitted = []
    monkeypatch.setattr(flyte, "run", lambda *a, **k: submitted.append(a))
    assert cli.main(["--iterations", "1"]) == 2
    err = capsys.readouterr().err
    assert "no Flyte cluster is configured" in err and "--local" in err and "flyte create config" in err
    assert submitted == []

    # with a config naming an endpoint, the check passes (a fresh interpreter: flyte caches the config it read)
    (tmp_path / ".flyte").mkdir()
    (tmp_path / ".flyte" / "config.yaml").write_text("admin:\n  endpoint: dns:///example.union.ai\n")
    check = subprocess.run(
        [sys.executable, "-c", "from grpo_flyte.launch.submit import require_cluster; require_cluster()"],
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("case", ["run_dir_under_a_file", "read_only_run_dir", "cache_is_a_file"])
def test_unusable_folders_are_one_line_before_any_work(tmp_path, monkeypatch, capsys, case):
    from grpo_flyte.launch import cli
    from grpo_flyte.models import folders
    from grpo_flyte.runtime import files

    monkeypatch.setattr(folders, "resolve_local_model", lambda model: pytest.fail("no work may start"))
    args = ["--local", "--iterations", "1", "--eval-size", "2"]
    if case == "run_dir_under_a_file":
        (tmp_path / "file").write_text("x")
        args += ["--run-dir", str(tmp_path / "file" / "run")]
        expected = "is a file; expected a folder"
    elif case == "read_only_run_dir":
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        if os.geteuid() == 0:  # root may write anywhere: say the folder is read-only for this user
            monkeypatch.setattr(files, "_can_write", lambda folder: folder != ro)
        args += ["--run-dir", str(ro / "run")]
        expected = "is read-only for this user"
    else:
        (tmp_path / "cache").write_text("not a folder")
        monkeypatch.setenv("GRPO_FLYTE_CACHE", str(tmp_path / "cache"))
        args += ["--run-dir", str(tmp_path / "run")]
        expected = "GRPO_FLYTE_CACHE"
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- cluster runs: --resume-run, large datasets


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--resume-run", "r1", "--seed", "3"], "--resume-run reruns the cluster run with its own inputs; drop --seed"),
        (["--resume-run", "r1", "--local"], "--resume-run continues a cluster run; a local run continues with --resume --run-dir DIR"),
    ],
)
def test_resume_run_refuses_what_it_cannot_honour(args, expected, monkeypatch, capsys):
    from grpo_flyte.launch import cli, submit

    monkeypatch.setattr(submit, "_connect", lambda: pytest.fail("nothing may be submitted"))
    assert cli.main(args) == 2
    assert capsys.readouterr().err.strip() == f"error: {expected}"


class _Runner:
    def __init__(self, error: Exception | None = None):
        self.error, self.calls = error, []

    def rerun(self, run_name, **kwargs):
        self.calls.append((run_name, kwargs))
        if self.error:
            raise self.error
        return type("Run", (), {"url": f"https://cluster/runs/{run_name}-2"})()


def test_resume_run_reruns_the_named_run_with_recovery(monkeypatch, capsys):
    from grpo_flyte.launch import cli, submit

    runner = _Runner()
    monkeypatch.setattr(submit, "_connect", lambda: runner)
    assert cli.main(["--resume-run", "r1"]) == 0
    assert runner.calls == [("r1", {"recover": True})]
    assert capsys.readouterr().out.strip() == "https://cluster/runs/r1-2"

    monkeypatch.setattr(submit, "_connect", lambda: _Runner(NotImplementedError("no RunSpec.relation")))
    assert cli.main(["--resume-run", "r1"]) == 2
    err = capsys.readouterr().err
    assert "--resume-run 'r1': this cluster cannot recover runs (no RunSpec.relation)" in err and len(err.splitlines()) == 1


def test_ctrl_c_before_a_run_starts_or_during_a_submission_is_one_line_and_130(monkeypatch, capsys):
    """A started local run says what it kept (tests/unit/launch/test_run_folder.py); before that, and while a
    cluster run is submitted, Ctrl-C is one line too, not a traceback."""
    from grpo_flyte.launch import cli

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_remote", interrupted)
    assert cli.main(["--iterations", "1"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_large_file_dataset_reaches_the_driver_as_a_folder(tmp_path, tiny_model_dir, monkeypatch):
    """Rows past Flyte's inline limit are uploaded as one folder (content-hashed) and read back by
    the driver: the driver trains on exactly the rows of the file."""
    import shutil

    import flyte
    from flyte.io import Dir

    from grpo_flyte import driver
    from grpo_flyte.launch import submit
    from grpo_flyte.runtime import storage
    from grpo_flyte.runtime.storage import payload_key
    from grpo_flyte.types import Example

    rows = [Example(question=f"What is {i} + 1?", answer=str(i + 1)) for i in range(12)]
    assert submit.examples_inputs(rows, tmp_path, lambda folder, key: pytest.fail("small: inline")) == {"examples": rows}
    monkeypatch.setattr(storage, "INLINE_LIMIT_BYTES", 0)
    uploads = []

    def upload(folder, key):  # a stand-in for Dir.from_local_sync: copy the folder to "remote" storage
        uploads.append(key)
        return Dir(path=str(shutil.copytree(folder, tmp_path / "remote")), hash=key)

    inputs = submit.examples_inputs(rows, tmp_path, upload)
    text = (tmp_path / "remote" / storage.PAYLOAD_FILE).read_text()
    assert uploads == [payload_key(text)] and inputs["examples"] == []

    seen = []
    split = driver.train_eval_split
    monkeypatch.setattr(driver, "train_eval_split", lambda config, examples: seen.append(examples) or split(config, examples))
    config = RunConfig(iterations=1, prompts_per_iter=2, group_size=2, max_new_tokens=4, eval_size=2, min_informative_groups=0)
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        driver.train_rl, config=config, base_model=Dir(path=str(tiny_model_dir)), **inputs
    )
    assert [row.iteration for row in run.outputs()[0].history] == [0, 1]
    assert seen == [rows]


# --------------------------------------------------------------------------- TRL's names as flags


def test_flags_take_underscores_and_trl_names():
    _, config, explicit = parse_args(["--num_generations", "6", "--max_completion_length=48", "--learning_rate", "1e-5", "--lora-r", "8"])
    flat = config.flat()
    assert (flat["group_size"], flat["max_new_tokens"], flat["learning_rate"], flat["lora_rank"]) == (6, 48, 1e-5, 8)
    assert {"group_size", "max_new_tokens", "learning_rate", "lora_rank"} <= explicit


@pytest.mark.parametrize("arg", ["--num-iterations", "--num_iterations"])
def test_num_iterations_is_trls_mu_and_the_loops_length_stays_iterations(arg):
    _, config, explicit = parse_args([arg, "2", "--iterations", "5"])
    assert (config.train.num_iterations, config.iterations) == (2, 5)
    assert {"num_iterations", "iterations"} <= explicit


def test_a_run_folder_saved_before_the_rename_resumes_with_its_length():
    """Saved configs are nested: a top-level 'num_iterations' is the loop's length of a folder saved
    before 2026-11, TRL's mu is train.num_iterations."""
    from grpo_flyte.launch.run_folder import saved_run_config

    old = RunConfig(iterations=7).model_dump(mode="json")
    old["num_iterations"] = old.pop("iterations")
    del old["train"]["num_iterations"]  # that folder's code had no mu
    restored = RunConfig.model_validate(saved_run_config(json.dumps(old)))
    assert (restored.iterations, restored.train.num_iterations) == (7, 1)
    new = RunConfig(iterations=7, num_iterations=3).model_dump(mode="json")
    restored = RunConfig.model_validate(saved_run_config(json.dumps(new)))
    assert (restored.iterations, restored.train.num_iterations) == (7, 3)


def test_help_speaks_in_words_with_one_default_per_flag():
    proc = subprocess.run([sys.executable, "-m", "grpo_flyte", "--help"], capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for python in ("{Path,null}", "null", "dict[", "tuple[", " int]", " float]", " str]"):
        assert python not in text, python
    # one entry per option: its help text (wrapped over lines) names at most one default
    entries = re.split(r"\n  (?=--)", text.split("options:", 1)[1])
    assert len(entries) > 50
    assert all(entry.count("(default:") <= 1 for entry in entries), [e for e in entries if e.count("(default:") > 1]
    assert "--rewards NAME=WEIGHT,..." in text and "(default: correct=1.0)" in " ".join(text.split())
    version = subprocess.run([sys.executable, "-m", "grpo_flyte", "--version"], capture_output=True, text=True, check=False, timeout=60)
    assert (version.returncode, version.stdout.strip()) == (0, "grpo-flyte 0.1.0")


# --------------------------------------------------------------------------- the model, checked before start


def test_lora_targets_are_checked_against_the_model_before_start(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from grpo_flyte.launch import cli, local_run
    from grpo_flyte.models import folders

    args = ["--local", "--model", str(tiny_model_dir), "--iterations", "1", "--eval-size", "2", "--run-dir", str(tmp_path / "run")]
    monkeypatch.setattr(local_run, "_run_locked", lambda *a, **k: pytest.fail("no work may start"))
    assert cli.main([*args, "--lora-target-modules", "q_proj,query_key_value"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --lora-target-modules 'query_key_value' names no linear layer of")
    assert "expected some of down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj, or 'all-linear'" in err
    assert not (tmp_path / "run").exists()
    assert folders.lora_target_problem(tiny_model_dir, ("all-linear",)) is None
    assert folders.lora_target_problem(tiny_model_dir, ("q_proj", "down_proj")) is None
    with pytest.raises(ConfigError, match="'all-linear' already names every linear layer"):
        make_config(lora_target_modules=("all-linear", "q_proj"))


def test_a_context_past_the_models_window_is_refused_before_start(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The tiny model's config.json: max_position_embeddings 1024. A prompt budget and a completion
    that add up past it are one line before any work, in a local run as on a cluster (vLLM would
    refuse the engine on the pod, retried; the transformers engine would run past the window).
    A RoPE scaling that stretches the window (linear, factor 2: 2048) lets it through, as vLLM
    does; YaRN's factor does not (vLLM reads max_position_embeddings as already stretched)."""
    import shutil

    from grpo_flyte.launch import cli, local_run, preflight
    from grpo_flyte.models.folders import context_window

    assert context_window(tiny_model_dir) == (1024, "max_position_embeddings in its config.json")
    args = ["--local", "--model", str(tiny_model_dir), "--iterations", "1", "--eval-size", "2", "--run-dir", str(tmp_path / "run")]
    monkeypatch.setattr(local_run, "_run_locked", lambda *a, **k: pytest.fail("no work may start"))
    assert cli.main([*args, "--max-prompt-tokens", "512", "--max-new-tokens", "600"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --max-prompt-tokens=512 + --max-new-tokens=600: 1112 tokens; expected at most the model's window, 1024 tokens "
        "(max_position_embeddings in its config.json): a shorter context, or, for a model whose window can be stretched, its "
        "RoPE scaling set in its config.json (docs/configuration.md#context-longer-than-the-model)"
    )
    assert not (tmp_path / "run").exists()
    # the cluster path's check (launch.submit) is the same function
    config = RunConfig(model=str(tiny_model_dir), max_prompt_tokens=512, max_new_tokens=600)
    with pytest.raises(ConfigError, match="1112 tokens; expected at most the model's window, 1024 tokens"):
        preflight.check_model_fits(config, tiny_model_dir, None)
    preflight.check_model_fits(RunConfig(model=str(tiny_model_dir), max_prompt_tokens=512, max_new_tokens=512), tiny_model_dir, None)
    stretched = tmp_path / "stretched"
    shutil.copytree(tiny_model_dir, stretched)
    settings = json.loads((stretched / "config.json").read_text())
    settings["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (stretched / "config.json").write_text(json.dumps(settings))
    assert context_window(stretched) == (2048, "max_position_embeddings in its config.json, x2 by its RoPE scaling")
    preflight.check_model_fits(config, stretched, None)
    settings["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    (stretched / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match="expected at most the model's window, 1024 tokens"):
        preflight.check_model_fits(config, stretched, None)


def test_all_linear_puts_lora_on_every_linear_layer_but_the_output(tiny_model_dir):
    from grpo_flyte.learning import policy

    config = RunConfig(model=str(tiny_model_dir), dtype="float32", lora_target_modules=("all-linear",))
    model = policy.peft_model(config.base, config.lora, str(tiny_model_dir))
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A") and name.count(".") > 3}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not hasattr(model.get_output_embeddings(), "lora_A") and "lm_head" not in str(adapted)


def test_overlong_prompts_are_counted_before_start(tmp_path, tiny_model_dir, monkeypatch, capsys, caplog):
    from grpo_flyte.launch import cli, local_run

    data = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
    rows[3]["question"] = "Please add these numbers carefully, showing each step. " * 8 + "What is 3 + 3?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--local", "--model", str(tiny_model_dir), "--dataset", str(data), "--eval-size", "2", "--iterations", "1",
            "--max-prompt-tokens", "100", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    monkeypatch.setattr(local_run, "_run_locked", lambda *a, **k: 0)
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --max-prompt-tokens 100: 1 of 10 prompts are longer than 100 tokens (the longest, ")
    assert "'Please add these numbers carefully" in err and err.endswith("add --overlong-prompts truncate")
    with caplog.at_level("WARNING", logger="grpo_flyte"):
        assert cli.main([*args, "--overlong-prompts", "truncate"]) == 0
    assert "1 of 10 prompts are longer than 100 tokens" in caplog.text and "each keeps its last 100 tokens" in caplog.text


def test_truncate_keeps_the_end_of_an_overlong_prompt(embedded_dir):
    from transformers import AutoTokenizer

    from grpo_flyte.types import Example

    tok = AutoTokenizer.from_pretrained(str(embedded_dir))
    example = Example(question="word " * 200 + "What is 2 + 2?", answer="4")
    full = tokenize_prompt(tok, example, RunConfig(max_prompt_tokens=4096).prompt)
    cut = tokenize_prompt(tok, example, RunConfig(max_prompt_tokens=64, overlong_prompts="truncate").prompt)
    assert len(full) > 200 and cut == full[-64:]
    with pytest.raises(ValueError, match="exceeds max_prompt_tokens=64"):
        tokenize_prompt(tok, example, RunConfig(max_prompt_tokens=64).prompt)


# --------------------------------------------------------------------------- cluster runs: the W&B link

_WANDB_DRY_RUN = """
import json, sys
from pathlib import Path
import flyte
from flyte.io import Dir
from grpo_flyte.launch import cli, submit

flyte.init(root_dir=Path(sys.argv[1]))
submitted = []


class DryRun:
    \"\"\"What `_connect` returns, submitting nothing: an offline remote dry run with the CLI's context.\"\"\"

    def __init__(self, custom_context):
        self.runner = flyte.with_runcontext(mode="remote", dry_run=True, custom_context=custom_context)

    def run(self, task, **inputs):
        submitted.append(self.runner.run(task, **inputs))
        return type("Run", (), {"url": "https://cluster/runs/r1"})()


submit._connect = lambda custom_context=None, env_vars=None: DryRun(custom_context)
submit.resolve_remote_model = lambda model: Dir(path="s3://bucket/model")
common = ["--model", sys.argv[2], "--iterations", "1", "--eval-size", "2"]
for argv in ([*common, "--wandb-project", "grpo-test"], common, [*common, "--wandb-project", "grpo-test", "--sweep", "seed=0,1"]):
    assert cli.main(argv) == 0
    tt = submitted[-1].task_spec.task_template
    args = list(tt.container.args)
    print(json.dumps({
        "links": [[link.name, link.uri] for link in tt.metadata.log_links],
        "context": submitted[-1].inputs.context,
        "task": [args[args.index("mod") + 1], args[args.index("instance") + 1]],
        "retries": tt.metadata.retries.retries,
    }))
"""


def test_a_cluster_run_with_wandb_links_the_driver_to_the_run_it_logs_to(tmp_path, tiny_model_dir):
    """The CLI chooses the W&B run before submitting: the run's context names it as
    flyteplugins-wandb writes it, the submitted driver task carries the plugin's link to it, and
    the task still resolves as grpo_flyte.driver.train_rl with its retries; without W&B, neither."""
    src = Path(__file__).resolve().parents[3] / "src"
    env = {**os.environ, "WANDB_ENTITY": "my-team", "GRPO_FLYTE_WANDB_SECRET": "wandb-api-key"}
    out = warm_python.run(["-c", _WANDB_DRY_RUN, src, tiny_model_dir], timeout=180, cwd=tmp_path, env=env, cli=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    with_wandb, without, swept = (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    context = with_wandb["context"]
    run_id = context["wandb_id"]
    assert (context["wandb_project"], context["wandb_entity"], len(run_id)) == ("grpo-test", "my-team", 12)
    assert with_wandb["links"] == [["Weights & Biases", f"https://wandb.ai/my-team/grpo-test/runs/{run_id}"]]
    assert with_wandb["task"] == without["task"] == ["grpo_flyte.driver", "train_rl"]
    assert with_wandb["retries"] == without["retries"] == 2
    assert f"W&B run {run_id} in project grpo-test" in out.stderr
    assert without["links"] == [] and not any(key.startswith("wandb") for key in without["context"])
    # a sweep: its id names the W&B group of its configs' runs (each config's own: tests/unit/test_sweep.py),
    # and the sweep task's link opens the group
    group = swept["context"]["wandb_group"]
    assert swept["task"] == ["grpo_flyte.sweep", "train_sweep"] and swept["context"]["wandb_id"] == group and len(group) == 12
    assert swept["links"] == [["Weights & Biases (the sweep's runs)", f"https://wandb.ai/my-team/grpo-test/groups/{group}"]]
    assert f"W&B group {group} in project grpo-test" in out.stderr


def test_a_cluster_run_with_wandb_needs_the_plugin_in_one_line(monkeypatch, capsys):
    from grpo_flyte.launch import cli, preflight, submit

    monkeypatch.setattr(preflight, "_installed", lambda module: module != "flyteplugins.wandb")
    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: pytest.fail("nothing may be submitted"))
    assert cli.main(["--wandb-project", "grpo-test", "--iterations", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --wandb-project 'grpo-test' on a cluster needs flyteplugins-wandb (the run's W&B link in the Flyte UI): " \
                  "pip install 'grpo-flyte[wandb]'\n"  # fmt: skip


def test_load_in_4bit_without_bitsandbytes_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    result = _main_in(tmp_path, monkeypatch, capsys, ["--local", "--load-in-4bit", "--run-dir", "D"], None)
    _check_bad_input(result, ["--load-in-4bit needs bitsandbytes", "pip install 'grpo-flyte[local]'"])


def test_more_train_processes_than_rollouts_per_step_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    argv = [
        "--local",
        "--train-processes",
        "5",
        "--prompts-per-iter",
        "2",
        "--group-size",
        "4",
        "--updates-per-iter",
        "2",
        "--run-dir",
        "D",
    ]
    result = _main_in(tmp_path, monkeypatch, capsys, argv, None)
    _check_bad_input(
        result,
        [
            "--train-processes=5 with 4 rollouts per optimizer step (--prompts-per-iter=2 x --group-size=4 / --updates-per-iter=2): expected at most 4"
        ],
    )


@pytest.mark.parametrize(
    ("variables", "start", "words"),
    [
        ({"GRPO_FLYTE_TRAIN_GPU": "L4:9"}, "error: GRPO_FLYTE_TRAIN_GPU='L4:9': not a GPU count", "expected L4:1 to L4:8"),
        # several nodes: a pod without rank 0 would write None as the step's result (issue 37)
        ({"GRPO_FLYTE_TRAIN_GPU": "L4:2", "GRPO_FLYTE_TRAIN_NODES": "2"}, "error: GRPO_FLYTE_TRAIN_NODES=2: expected 1;", "A100:8"),
    ],
)
def test_train_gpus_or_nodes_the_plugin_cannot_run_are_one_line_before_submitting(tmp_path, variables, start, words):
    """GRPO_FLYTE_TRAIN_GPU=L4:9 (flyte.Resources takes 1-8 GPUs of a type per node), or more than
    one train node: one line from the CLI, before anything is submitted, instead of an error at
    import or a step whose result is lost."""
    env = {**_env(tmp_path), **variables, "PYTHONPATH": str(Path(grpo_flyte.__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "grpo_flyte.driver", "--iterations", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(start) and words in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("argv", "gpu", "words"),
    [
        (["--train-processes", "2"], "L4:1", "--train-processes 2 is for local runs; on a cluster the train GPUs set the processes"),
        (["--prompts-per-iter", "1", "--group-size", "2"], "L4:4", "4 train processes (GRPO_FLYTE_TRAIN_GPU=L4:4 x"),
        (
            ["--prompts-per-iter", "1", "--group-size", "2"],
            "L4:4",
            "with 2 rollouts per optimizer step (--prompts-per-iter=1 x --group-size=2 / --updates-per-iter=1): expected at most 2",
        ),
    ],
)
def test_cluster_train_processes_are_checked_before_submitting(monkeypatch, capsys, argv, gpu, words):
    from grpo_flyte import envs
    from grpo_flyte.launch import cli, submit

    monkeypatch.setattr(envs.settings, "train_gpu", gpu)
    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: pytest.fail("nothing may be submitted"))
    assert cli.main([*argv, "--iterations", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_report_to_takes_a_comma_separated_list_or_none_and_names_what_it_expects():
    from grpo_flyte.launch.cli import parse_args

    _, config, _ = parse_args(["--report-to", "mlflow,tensorboard", "--log-completions", "--num-completions-to-log", "4"])
    assert (config.report_to, config.trackers, config.log_completions, config.num_completions_to_log) == (
        ("mlflow", "tensorboard"), ("mlflow", "tensorboard"), True, 4,
    )  # fmt: skip
    assert parse_args(["--report-to", "none"])[1].report_to == ()
    assert parse_args(["--wandb-project", "p", "--report-to", "trackio"])[1].trackers == ("trackio", "wandb")  # W&B implied
    assert RunConfig().trackers == () and not RunConfig().log_completions  # the default logs nowhere else
    for bad, words in (("comet", "'comet'"), ("all", "would change with the environment")):
        with pytest.raises(ConfigError) as info:
            parse_args(["--report-to", bad])
        assert words in str(info.value) and "expected a comma-separated list of wandb, trackio, mlflow, tensorboard, or none" in str(
            info.value
        )


@pytest.mark.parametrize("tracker", ["trackio", "mlflow", "tensorboard"])
def test_a_tracker_not_installed_is_one_line_naming_its_extra_before_any_work(tmp_path, monkeypatch, capsys, tracker):
    from grpo_flyte.launch import preflight

    monkeypatch.setattr(preflight, "_installed", lambda module: module != tracker)
    result = _main_in(tmp_path, monkeypatch, capsys, ["--local", "--report-to", tracker, "--run-dir", "D"], None)
    _check_bad_input(result, [f"--report-to {tracker} needs the {tracker} package: pip install 'grpo-flyte[{tracker}]'"])


def test_on_a_cluster_each_tracker_must_log_where_the_driver_pod_outlives_and_gets_its_settings(monkeypatch):
    from grpo_flyte.launch.preflight import check_trackers, tracking_env

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="tensorboard writes event files under the local run folder"):
        check_trackers(RunConfig(report_to="tensorboard"), local=False)
    check_trackers(RunConfig(report_to="tensorboard,mlflow,trackio"), local=True)  # a local run keeps them in its folder
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    with pytest.raises(UserError, match=r"needs MLFLOW_TRACKING_URI set here to a tracking server .* got file:///tmp/mlruns"):
        check_trackers(RunConfig(report_to="mlflow"), local=False)
    with pytest.raises(UserError, match="trackio on a cluster needs TRACKIO_SPACE_ID"):
        check_trackers(RunConfig(report_to="trackio"), local=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.com")
    monkeypatch.setenv("TRACKIO_SPACE_ID", "me/runs")
    config = RunConfig(report_to="mlflow,trackio")
    check_trackers(config, local=False)
    assert tracking_env(config) == {"MLFLOW_TRACKING_URI": "https://mlflow.example.com", "TRACKIO_SPACE_ID": "me/runs"}
    assert tracking_env(RunConfig(report_to="trackio")) == {"TRACKIO_SPACE_ID": "me/runs"}  # only what the run's trackers read
