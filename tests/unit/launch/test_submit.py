"""A cluster submission from the submitting machine's side (no cluster here): what is checked before
anything is submitted, what the run context is, and that inputs still exist when Flyte uploads them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.launch import cli, submit
from grpo_flyte.runtime import storage
from tests.support import SUPPORT

ROOT = Path(__file__).resolve().parents[3]


class _Submitted(Exception):
    """Raised by the stand-in runner: the run was handed to Flyte."""


class _FakeHub:
    """huggingface_hub.snapshot_download without a network: serves `repos` (repo id -> a local model
    folder) as the Hub does, only the files `allow_patterns` match (huggingface_hub's own filter),
    copied into a snapshot folder of the Hugging Face cache's shape; records what it served. With
    `down`, every call fails as the Hub does without a network."""

    def __init__(self, cache: Path, repos: dict[str, Path], down: bool = False):
        self.cache, self.repos, self.down, self.served = cache, repos, down, []

    def __call__(self, repo_id: str, allow_patterns=None, **_):
        from huggingface_hub.errors import LocalEntryNotFoundError
        from huggingface_hub.utils import filter_repo_objects

        if self.down:
            raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened ...")
        snapshot = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
        snapshot.mkdir(parents=True, exist_ok=True)
        for name in filter_repo_objects(sorted(p.name for p in self.repos[repo_id].iterdir()), allow_patterns=allow_patterns):
            shutil.copy(self.repos[repo_id] / name, snapshot / name)
            self.served.append(name)
        return str(snapshot)


def test_a_large_dataset_folder_still_exists_when_flyte_uploads_it(tmp_path, monkeypatch, tiny_model_dir):
    """The real Dir.from_local_sync outside a task defers its upload to runner.run: the folder it
    names must still be there then (it was a TemporaryDirectory already removed)."""
    rows = "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(40))
    (tmp_path / "data.jsonl").write_text(rows)
    monkeypatch.setattr(storage, "INLINE_LIMIT_BYTES", 0)  # every dataset file is "too large" to pass inline
    seen = {}

    class Runner:
        def run(self, task, **inputs):
            (folder,) = inputs["examples_file"]
            seen["folder"] = Path(folder.path)
            seen["exists"] = seen["folder"].is_dir() and (seen["folder"] / storage.PAYLOAD_FILE).is_file()
            raise _Submitted

    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: Runner())
    monkeypatch.setattr(submit, "resolve_remote_model", lambda model: Dir(path="s3://bucket/model"))
    config = RunConfig(model=str(tiny_model_dir), dataset=str(tmp_path / "data.jsonl"), eval_size=4, iterations=1)
    with pytest.raises(_Submitted):
        submit.run_remote(config)
    assert seen["exists"], f"{seen['folder']} was removed before Flyte could upload it"


def test_a_cluster_sweep_over_two_bases_sends_each_config_its_own_base_model_uploaded_once(
    tmp_path, monkeypatch, tiny_model_dir, embedded_dir
):
    """train_sweep gets a folder per base model, each uploaded once however many configs use it,
    and each config's model names its folder; a lone run still gets its one `base_model`."""
    from tests.support.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "tiny-b", embedded_dir, seed=1)
    uploaded, submitted = [], []

    class Runner:
        def run(self, task, **inputs):
            submitted.append((task.name, inputs))
            return type("Run", (), {"url": "dry-run"})()

    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: Runner())
    monkeypatch.setattr(submit, "resolve_remote_model", lambda model: uploaded.append(model) or Dir(path=f"s3://bucket/{Path(model).name}"))
    tiny = ["--backend", "hf", "--iterations", "1", "--max-new-tokens", "8", "--group-size", "2", "--prompts-per-iter", "2"]
    assert cli.main([*tiny, "--sweep", f"model={tiny_model_dir},{other}", "--sweep", "seed=0,1"]) == 0
    ((task, inputs),) = submitted
    assert task.endswith("train_sweep") and "base_model" not in inputs and sorted(uploaded) == sorted([str(tiny_model_dir), str(other)])
    assert {m: d.path for m, d in inputs["base_models"].items()} == {
        str(tiny_model_dir): "s3://bucket/tiny-model0",
        str(other): "s3://bucket/tiny-b",
    }
    assert {m.config.base.model for m in inputs["members"]} == inputs["base_models"].keys() and len(inputs["members"]) == 4

    uploaded.clear()
    assert cli.main([*tiny, "--model", str(other)]) == 0
    assert (
        submitted[-1][0].endswith("train_rl") and submitted[-1][1]["base_model"].path == "s3://bucket/tiny-b" and uploaded == [str(other)]
    )


def test_a_cluster_run_sends_each_reward_model_as_a_folder_checked_here_when_it_is_local(
    tmp_path, monkeypatch, capsys, tiny_model_dir, embedded_dir
):
    """train_rl gets `reward_models`, one folder per model its rewards name (without '@label'): a
    local folder checked here, then uploaded; a Hub id prefetched (checked here when the Hub can be
    read, which here it cannot: `test_a_hub_base_model_is_checked_before_submitting_...`).
    A local folder that is no reward model is refused before anything is submitted."""
    import huggingface_hub

    from tests.support.tiny_model import build_tiny_reward_model

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _FakeHub(tmp_path / "hub", {}, down=True))

    folder = build_tiny_reward_model(tmp_path / "rm", embedded_dir, num_labels=2)
    uploaded, submitted = [], []

    class Runner:
        def run(self, task, **inputs):
            submitted.append((task.name, inputs))
            return type("Run", (), {"url": "dry-run"})()

    def remote(model, field="model"):
        uploaded.append((model, field))
        return Dir(path=f"s3://bucket/{Path(model).name}")

    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: Runner())
    monkeypatch.setattr(submit, "resolve_remote_model", remote)
    tiny = ["--model", str(tiny_model_dir), "--backend", "hf", "--iterations", "1", "--max-new-tokens", "8", "--group-size", "2"]
    assert cli.main([*tiny, "--rewards", f"correct=1,{folder}@right=0.5,org/some-rm=0.25"]) == 0
    ((task, inputs),) = submitted
    assert task.endswith("train_rl") and {m: d.path for m, d in inputs["reward_models"].items()} == {
        str(folder): "s3://bucket/rm",
        "org/some-rm": "s3://bucket/some-rm",
    }
    assert (str(folder), "rewards") in uploaded and ("org/some-rm", "rewards") in uploaded
    uploaded.clear()
    assert cli.main([*tiny, "--rewards", f"{folder}=1"]) == 2  # two labels, none picked
    assert "the model has 2 labels" in capsys.readouterr().err and uploaded == [] and len(submitted) == 1


def _refused(argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: pytest.fail("nothing may be submitted"))
    monkeypatch.setattr(submit, "resolve_remote_model", lambda model: pytest.fail("nothing may be uploaded"))
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_a_hub_base_model_is_checked_before_submitting_from_its_config_and_tokenizer_alone(
    tmp_path, monkeypatch, capsys, caplog, tiny_model_dir
):
    """A Hub base model gets the checks a local folder gets (LoRA targets, the context against the
    model's window, a reward model's kind), in the same one line, before anything is submitted,
    from its config and tokenizer files alone: no weights are fetched here. Where the Hub cannot
    be reached from here, one line says so and the submission goes on (the cluster fetches it)."""
    import huggingface_hub

    hub = _FakeHub(tmp_path / "hub", {"org/tiny": tiny_model_dir})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    tiny = ["--backend", "hf", "--iterations", "1", "--eval-size", "2"]
    cases = (
        ["--lora-target-modules", "q_proj,query_key_value"],
        ["--max-prompt-tokens", "512", "--max-new-tokens", "600"],
        ["--rewards", "correct=1,{model}=0.5"],
    )
    for flags in cases:
        local = _refused([*tiny, "--model", str(tiny_model_dir), *[f.format(model=tiny_model_dir) for f in flags]], monkeypatch, capsys)
        on_hub = _refused([*tiny, "--model", "org/tiny", *[f.format(model="org/tiny") for f in flags]], monkeypatch, capsys)
        assert on_hub.count("\n") == 1 and on_hub == local.replace(str(tiny_model_dir), "org/tiny").replace(tiny_model_dir.name, "org/tiny")
    assert "names no linear layer of org/tiny" in _refused([*tiny, "--model", "org/tiny", *cases[0]], monkeypatch, capsys)
    assert "config.json" in hub.served and "tokenizer.json" in hub.served
    assert not [name for name in hub.served if name.endswith((".safetensors", ".bin"))]

    submitted = []

    class Runner:
        def run(self, task, **inputs):
            submitted.append(inputs["base_model"].path)
            return type("Run", (), {"url": "dry-run"})()

    monkeypatch.setattr(submit, "_connect", lambda custom_context=None, env_vars=None: Runner())
    monkeypatch.setattr(submit, "resolve_remote_model", lambda model, field="model": Dir(path=f"s3://bucket/{model}"))
    assert cli.main([*tiny, "--model", "org/tiny"]) == 0 and submitted == ["s3://bucket/org/tiny"]  # it fits: submitted
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _FakeHub(tmp_path / "hub2", {}, down=True))
    with caplog.at_level("WARNING", logger="grpo_flyte"):
        assert cli.main([*tiny, "--model", "org/tiny", *cases[0]]) == 0  # unchecked here: the cluster's to find
    assert submitted == ["s3://bucket/org/tiny"] * 2
    (line,) = [r.getMessage() for r in caplog.records if "org/tiny" in r.getMessage()]
    assert line.startswith("--model 'org/tiny': the Hugging Face Hub cannot be read from here (LocalEntryNotFoundError: Got: ConnectError")
    assert line.endswith("its checks are left to the cluster, which fetches it") and "\n" not in line


def test_wandb_on_a_cluster_without_its_secret_is_refused_in_one_line(monkeypatch, capsys):
    from grpo_flyte import envs

    monkeypatch.setattr(envs.settings, "wandb_secret", None)
    err = _refused(["--wandb-project", "grpo-test", "--iterations", "1"], monkeypatch, capsys)
    assert err == (
        "error: --wandb-project 'grpo-test' on a cluster needs your W&B API key as a Flyte secret: create it "
        "(flyte create secret wandb-api-key) and name it in GRPO_FLYTE_WANDB_SECRET=wandb-api-key\n"
    )


def test_a_lora_rank_vllm_cannot_serve_is_refused_before_submitting(monkeypatch, capsys):
    err = _refused(["--lora-rank", "1024", "--lora-alpha", "2048", "--iterations", "1"], monkeypatch, capsys)
    assert err.startswith("error: --lora-rank 1024: vLLM, which generates on a cluster's GPUs, serves LoRA ranks up to 512;")
    assert err.count("\n") == 1


def test_a_custom_reward_outside_the_code_bundle_is_refused_naming_where_to_put_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text("def short(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _refused(["--rewards", "my_rewards:short=1.0", "--iterations", "1"], monkeypatch, capsys)
    where = str(submit.BUNDLE_ROOT / "my_rewards.py")
    assert err == (
        f"error: 'my_rewards:short': module 'my_rewards' is at {str(tmp_path / 'my_rewards.py')!r}, outside the code bundle "
        f"(only modules under {str(submit.BUNDLE_ROOT)!r} travel with a run): move it there, e.g. {where!r}\n"
    )
    # the same module under the bundle root ships
    monkeypatch.setattr(submit, "BUNDLE_ROOT", tmp_path)
    submit.check_submission(RunConfig(rewards={"my_rewards:short": 1.0}))


def test_a_custom_environment_outside_the_code_bundle_is_refused(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SUPPORT))  # tests/support/chatty_env.py
    err = _refused(["--env", "chatty_env:Chatty", "--iterations", "1"], monkeypatch, capsys)
    assert err.startswith("error: 'chatty_env:Chatty': module 'chatty_env' is at ") and "outside the code bundle" in err


_WHEEL_SUBMISSION = """
import json, sys
import flyte
from flyte.io import Dir
import grpo_flyte
from grpo_flyte.launch import submit
from grpo_flyte.config.run import RunConfig
from grpo_flyte.driver import train_rl

flyte.init()
options = submit.run_context_options()
runner = flyte.with_runcontext(mode="remote", dry_run=True, **options)
run = runner.run(train_rl, config=RunConfig(iterations=1), base_model=Dir(path="s3://bucket/model"))
spec = run.task_spec.task_template
print(json.dumps({"package": grpo_flyte.__file__, "options": {k: v for k, v in options.items() if v is not None},
                  "args": list(spec.container.args)}))
"""


def test_an_installed_wheel_submits_naming_its_code_by_version(tmp_path):
    """Built as a user installs it, outside the checkout: the submission (an offline remote dry run
    with the CLI's run context) gets copy_style 'none' and a version, which Flyte requires then."""
    project = tmp_path / "project"  # a copy: a build writes build/ and egg-info beside the sources
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(project)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("grpo_flyte-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    site = next(env_dir.glob("lib/python3.*/site-packages"))
    # this environment's dependencies, but not its editable grpo_flyte: a plain path entry does not
    # run the .pth hooks of the folder it adds
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "flyte").is_dir())
    (site / "deps.pth").write_text(f"{deps}\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(env_dir / "bin" / "python"), "-c", _WHEEL_SUBMISSION], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["package"]).is_relative_to(site)  # the wheel's code, not the checkout's
    assert result["options"]["copy_style"] == "none"
    assert result["options"]["version"].startswith("0.1.0-") and len(result["options"]["version"]) == len("0.1.0-") + 12
    assert "grpo_flyte.driver" in result["args"]


_CHECKOUT_SUBMISSION = """
import json
from pathlib import Path
import flyte
from flyte.io import Dir
from grpo_flyte.launch import submit
from grpo_flyte.config.run import RunConfig
from grpo_flyte.driver import train_rl

flyte.init(root_dir=submit.BUNDLE_ROOT)
runner = flyte.with_runcontext(mode="remote", dry_run=True, **submit.run_context_options())
run = runner.run(train_rl, config=RunConfig(iterations=1), base_model=Dir(path="s3://bucket/model"))
print(json.dumps(sorted(str(Path(f).resolve().relative_to(submit.BUNDLE_ROOT)) for f in run.code_bundle.files)))
"""


def test_a_checkout_submission_bundles_every_module_of_the_package(tmp_path):
    """The bundle holds the modules the submitting process loaded; a pod imports some only when a
    task runs (the engine's decode loop and prefix cache, the data-parallel step), so every module
    of the package is in it, not only those the driver imports (a fresh interpreter, as the CLI)."""
    out = subprocess.run(
        [sys.executable, "-c", _CHECKOUT_SUBMISSION], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    bundled = set(json.loads(out.stdout.strip().splitlines()[-1]))
    package = {str(p.relative_to(submit.BUNDLE_ROOT)) for p in submit.PACKAGE_DIR.rglob("*.py")}
    assert package - bundled == set()


def _filled(model, rewards: list[str]):
    """`model` with every field set to a value as large as a run writes: floats and ints at their
    widest MessagePack forms, strings of 300 characters (a guard's reason), a literal's longest
    value, a mean per reward name."""
    import types
    import typing

    values = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is typing.Literal:
            values[name] = max(typing.get_args(kind), key=len)
        elif kind is str:
            values[name] = "x" * 300
        elif typing.get_origin(kind) is dict:
            wide = 2**40 if typing.get_args(kind)[1] is int else 0.123456789
            values[name] = {f"{reward}/{name}": wide for reward in rewards}
        elif kind is bool:
            values[name] = True
        elif kind is int:
            values[name] = 2**40
        else:
            values[name] = 0.123456789
    return model(**values)


def test_a_sweep_whose_metrics_history_could_pass_flytes_inline_limit_is_refused_before_submitting():
    from grpo_flyte.records import EvalMetrics, GuardRecord, TrainMetrics
    from grpo_flyte.types import MetricsRow

    rewards = ["correct", "format", "correct_format"]
    row = MetricsRow(
        iteration=2**20, adapter_version=2**20, train=_filled(TrainMetrics, rewards), eval=_filled(EvalMetrics, rewards),
        guard=_filled(GuardRecord, rewards),
    )  # fmt: skip
    # the bound the check uses holds for a row with every field filled
    assert storage.inline_size(row) <= submit.HISTORY_ROW_BYTES + submit.HISTORY_ROW_BYTES_PER_REWARD * len(rewards)

    config = RunConfig(rewards={name: 1.0 for name in rewards})
    row_bytes = submit.HISTORY_ROW_BYTES + submit.HISTORY_ROW_BYTES_PER_REWARD * len(rewards)
    most = storage.FLYTE_INLINE_LIMIT_BYTES // row_bytes - 1
    submit.check_history_inline(config.model_copy(update={"iterations": most}))
    with pytest.raises(Exception) as refused:
        submit.check_history_inline(config.model_copy(update={"iterations": most + 1}))
    assert str(refused.value) == (
        f"--iterations {most + 1} in a cluster sweep: each config returns its metrics history inline, up to {row_bytes} "
        f"bytes an iteration, and Flyte's inline limit is 10 MiB; expected at most {most} iterations (or run the configs "
        "as separate runs)"
    )


def test_a_tool_outside_the_code_bundle_is_refused_naming_where_to_put_it(monkeypatch, capsys):
    """A --tools function runs in the rollout pod's sandbox: its module must travel with the code
    bundle, as a reward's and an environment's do."""
    monkeypatch.syspath_prepend(str(SUPPORT))  # tests/support/tool_fns.py
    err = _refused(["--tools", "tool_fns:add", "--iterations", "1"], monkeypatch, capsys)
    assert err.startswith("error: 'tool_fns:add': module 'tool_fns' is at ") and "outside the code bundle" in err
