"""The leaf tasks run as pods: Flyte's own spec, code bundle, entrypoint (`a0`) and input/output files.

No cluster is reachable here, so each task is rehearsed the way a pod runs it (see
`pod_rehearsal`): the CLI's cluster path submits a checkout of this package as an offline dry run,
which builds the code bundle; each task's container args come from `flyte.extras.serialize_env`;
`a0` runs them in an empty folder with an interpreter that has every dependency but not grpo_flyte,
so the package can only come from the bundle. Data moves between pods only through the files
Flyte writes: inputs.pb, outputs.pb, error.pb and the raw data prefix.

The checkout is a copy of this worktree's package with a team's reward module in its src/ (so it
ships); a second reward module sits outside the checkout, importable where the CLI runs but not
shipped, the mistake the rehearsal has to catch. It is submitted with two train GPUs, so the
data-parallel train step is declared too and runs through `a0` under flyteplugins-pytorch's own
launcher (two gloo processes). One warm replica (`pod_rehearsal.Replica`) runs many actions of two
runs in one long-lived process, as unionai-reuse's executor does. Last, the checkout is submitted
again with `--agent` and a team's agent and tools modules in its src/, and `generate` pods play
`--tools` and `--agent` episodes with them, imported from the bundle (issue 52).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import math
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from flyte.io import Dir
from flyteidl2.core import execution_pb2

from grpo_flyte.config.run import RunConfig
from grpo_flyte.judge import judge_group, reward_model_group
from grpo_flyte.reward import score_group, start_reward_workers
from grpo_flyte.rollout import generate
from grpo_flyte.trainer import init_adapter, train_step
from grpo_flyte.types import (
    OPTIMIZER_FILE,
    STATE_FILE,
    AdapterRef,
    Example,
    JudgeVerdict,
    RewardModelScores,
    Rollout,
    RolloutGroup,
    ScoredGroup,
    TrainStepResult,
)
from tests.support.pod_rehearsal import RAW_SCHEMES, Call, Rehearsal, Replica, image_python, local_path, run_submission
from tests.support.tiny_model import scored_pair

REWARD_MODULE = "def digits(completions, **kwargs):\n    return [float(sum(ch.isdigit() for ch in c)) for c in completions]\n"
SHIPPED, STRAY = "team_rewards:digits", "stray_rewards:digits"
PACKAGE = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, tiny_model_dir) -> Rehearsal:
    root = tmp_path_factory.mktemp("pod-rehearsal")
    checkout = root / "checkout"
    shutil.copytree(PACKAGE / "src" / "grpo_flyte", checkout / "src" / "grpo_flyte", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE / "pyproject.toml", checkout)  # a checkout, so the CLI ships its code in the bundle
    (checkout / "src" / "team_rewards.py").write_text(REWARD_MODULE)
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "stray_rewards.py").write_text(REWARD_MODULE)
    bin_dir = image_python(root / "image")
    (root / "submission").mkdir()
    rewards = f"correct=1.0,{SHIPPED}=0.5"  # the CLI refuses STRAY before submitting (tests/unit/launch/test_submit.py)
    # two train GPUs: the submission declares the data-parallel train step too
    settings = {"GRPO_FLYTE_TRAIN_GPU": "L4:2"}
    submission = run_submission(bin_dir, checkout / "src", root / "elsewhere", root / "submission", tiny_model_dir, rewards, settings)
    return Rehearsal(root / "run", bin_dir, submission)


@pytest.fixture(scope="module")
def base_model(tiny_model_dir) -> Dir:
    """The tiny model as pods get a base model: a Dir in remote storage, which each pod downloads."""
    return Dir(path=tiny_model_dir.as_uri())


CONFIG = RunConfig(group_size=2, max_new_tokens=4, learning_rate=1e-2, dtype="float32", kl_monitor_every=1, backend="hf")


@pytest.fixture(scope="module")
def adapter_v0(rehearsal, base_model):
    pod = rehearsal.run(init_adapter, CONFIG.base, CONFIG.lora, CONFIG.seed, base_model)
    assert pod.error is None, pod.log[-4000:]
    return pod


def test_the_submission_ships_the_package_and_only_the_reward_module_under_its_root(rehearsal):
    submission = rehearsal.submission
    files = set(submission["bundle"]["files"])
    assert {"grpo_flyte/reward.py", "grpo_flyte/trainer.py", "grpo_flyte/rollout.py", "team_rewards.py"} <= files
    assert not any("stray_rewards" in f for f in files)  # importable on the submitting machine, but outside src/
    for name, module in [("score_group", "grpo_flyte.reward"), ("train_step", "grpo_flyte.trainer"), ("generate", "grpo_flyte.rollout")]:
        [args] = [t["args"] for task, t in submission["tasks"].items() if task.endswith(f".{name}")]
        assert args[0] == "a0" and args[args.index("--tgz") + 1] == submission["bundle"]["tgz"]
        assert args[args.index("--resolver") + 1 :] == [
            "flyte._internal.resolvers.default.DefaultTaskResolver",
            "mod",
            module,
            "instance",
            name,
        ]
    # the image alone has no grpo_flyte: a pod that runs it got it from the bundle
    probe = subprocess.run(
        [str(rehearsal.bin_dir / "python"), "-c", "import grpo_flyte"], capture_output=True, text=True, env={}, check=False
    )
    assert "No module named 'grpo_flyte'" in probe.stderr


def _rollout(text: str) -> Rollout:
    return Rollout(completion_ids=[1, 2], sampling_logprobs=[-0.1, -0.2], finish_reason="stop", text=text)


GROUP = RolloutGroup(
    index=0,
    example=Example(question="What is 4 + 5?", answer="9"),
    adapter_version=0,
    prompt_ids=[1],
    rollouts=[_rollout("#### 9"), _rollout("4 + 5 = 9\n#### 9"), _rollout("no idea")],
    generate_s=0.0,
)


def test_score_group_pod_scores_with_the_custom_reward_from_the_bundle(rehearsal):
    config = RunConfig(rewards={"correct": 1.0, SHIPPED: 0.5})
    pod = rehearsal.run(score_group, config.scoring, config.sampling, GROUP)
    assert pod.error is None, pod.log[-4000:]
    scored = pod.outputs
    assert isinstance(scored, ScoredGroup) and scored.group == GROUP
    # correct 1, 1, 0; digits 1, 4, 0 at weight 0.5
    assert [p.reward for p in scored.rewards] == pytest.approx([1.5, 3.0, 0.0])
    assert [p.scores for p in scored.rewards] == [
        {"correct": 1.0, SHIPPED: 1.0},
        {"correct": 1.0, SHIPPED: 4.0},
        {"correct": 0.0, SHIPPED: 0.0},
    ]
    assert (pod.workdir / "team_rewards.py").is_file() and (pod.workdir / "grpo_flyte" / "reward.py").is_file()  # a0 unpacked the bundle


def test_start_reward_workers_pod_starts_the_workers_it_is_asked_for(rehearsal):
    pod = rehearsal.run(start_reward_workers, 2)
    assert pod.error is None, pod.log[-4000:]
    assert pod.outputs == 2  # two worker processes, started side by side in the pod


def test_a_reward_module_left_out_of_the_bundle_fails_the_pod_not_retried(rehearsal, monkeypatch):
    # importable where the run is started (the CLI refuses it before submitting: this is why)...
    monkeypatch.syspath_prepend(str(rehearsal.root.parent / "elsewhere"))  # the fixture's folder outside the checkout
    assert importlib.import_module("stray_rewards").digits(["19"]) == [2.0]
    # ...but not in the pod
    config = RunConfig(rewards={"correct": 1.0, STRAY: 0.5})
    pod = rehearsal.run(score_group, config.scoring, config.sampling, GROUP)
    assert pod.outputs is None
    message = pod.error.error.message
    assert message.startswith(
        f"rewards {STRAY!r}: cannot import module 'stray_rewards' (ModuleNotFoundError: No module named 'stray_rewards')"
    )
    assert "in the task image on a cluster" in message
    assert (pod.error.error.code, pod.error.error.kind) == ("NonRecoverableError", execution_pb2.ContainerError.NON_RECOVERABLE)


def _lora(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("raw_scheme", RAW_SCHEMES)
def test_init_adapter_then_two_train_step_pods_hand_the_adapter_on(rehearsal, base_model, adapter_v0, raw_scheme, monkeypatch):
    """A shared file system (`file://`) and an object store (`local://`: uploads and downloads as with s3).
    On `file://` the init_adapter pod is `adapter_v0`'s, the same action with the same inputs."""
    import torch

    monkeypatch.setattr(rehearsal, "raw_scheme", raw_scheme)
    if raw_scheme == "file://":
        first = adapter_v0
    else:
        first = rehearsal.run(
            init_adapter, CONFIG.base, CONFIG.lora, CONFIG.seed, Dir(path=raw_scheme + base_model.path.removeprefix("file://"))
        )
    assert first.error is None, first.log[-4000:]
    base = Dir(path=raw_scheme + base_model.path.removeprefix("file://"))
    v0 = first.outputs
    assert v0.version == 0
    # uploaded under the pod's raw data prefix, still there after the pod is gone
    folders = [local_path(v0.dir.path)]
    assert folders[0].is_relative_to(first.raw_data) and json.loads((folders[0] / STATE_FILE).read_text()) == {"version": 0}
    adapter = v0
    for version in (1, 2):
        pod = rehearsal.run(
            train_step, CONFIG.base, CONFIG.lora, CONFIG.train, CONFIG.sampling, base, adapter, [scored_pair(0), scored_pair(1)]
        )
        assert pod.error is None, pod.log[-4000:]
        result = pod.outputs
        assert result.adapter.version == version and (result.num_rollouts, result.num_contributing) == (4, 4)
        assert result.stats.num_updates == 1 and result.stats.num_tokens == 2 * (3 + 2) and result.stats.grad_norm > 0
        folder = local_path(result.adapter.dir.path)
        assert folder.is_relative_to(pod.raw_data) and (folder / OPTIMIZER_FILE).is_file()
        assert json.loads((folder / STATE_FILE).read_text()) == {"version": version}
        folders.append(folder)
        adapter = result.adapter
    v0_lora, v1_lora, v2_lora = (_lora(f) for f in folders)
    assert v0_lora.keys() == v1_lora.keys() == v2_lora.keys() and all("lora_" in k for k in v0_lora)
    assert all(not t.any() for k, t in v0_lora.items() if "lora_B" in k)  # v0 is the base model
    # Each step moved the weights. Step 2 started from step 1's adapter: from v0 again (same
    # inputs, fresh optimizer) it would have written v1's weights exactly.
    assert any(not torch.equal(v0_lora[k], v1_lora[k]) for k in v0_lora)
    assert any(not torch.equal(v1_lora[k], v2_lora[k]) for k in v1_lora)


def test_generate_pod_samples_a_group_on_the_tiny_model(rehearsal, base_model, adapter_v0):
    from transformers import AutoTokenizer

    from grpo_flyte.engine.prompts import tokenize_prompt

    example = Example(question="What is 1 + 2?", answer="3")
    pod = rehearsal.run(
        generate, CONFIG.base, CONFIG.engine, CONFIG.prompt, CONFIG.sampling, CONFIG.episode, base_model, adapter_v0.outputs, example, 3, 7
    )
    assert pod.error is None, pod.log[-4000:]
    group = pod.outputs
    assert isinstance(group, RolloutGroup) and (group.index, group.example, group.adapter_version) == (3, example, 0)
    tokenizer = AutoTokenizer.from_pretrained(local_path(base_model.path))
    assert group.prompt_ids == tokenize_prompt(tokenizer, example, CONFIG.prompt)  # the pod's chat template
    assert len(group.rollouts) == CONFIG.sampling.group_size
    for rollout in group.rollouts:
        assert 1 <= len(rollout.completion_ids) <= CONFIG.sampling.max_new_tokens
        assert len(rollout.sampling_logprobs) == len(rollout.completion_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in rollout.sampling_logprobs)


@pytest.mark.parametrize("rubric_fits", [True, False])
def test_judge_group_pod_judges_a_group_in_one_call_on_the_judge_model(rehearsal, base_model, rubric_fits):
    """The judge's pod: the judge model comes in as a Dir, the bundle brings grpo_flyte.judge. The
    tiny random model, which left alone writes noise, is held to the scores' regex: its one reply
    parses. A rubric that leaves no room in the judge's context fails the pod, not retried (the same
    judge would fail the same way; the CLI refuses it before start, a task called directly here)."""
    fit = {} if rubric_fits else {"judge_rubric": "Prefer correct answers that show their work. " * 40, "judge_context_tokens": 256}
    config = RunConfig(rewards={"judge": 1.0}, judge_model="tiny", backend="hf", **fit)
    pod = rehearsal.run(judge_group, config.judge, config.engine, config.scoring, base_model, GROUP)
    if rubric_fits:
        assert pod.error is None, pod.log[-4000:]
        verdict = pod.outputs
        assert isinstance(verdict, JudgeVerdict)
        assert (verdict.calls, verdict.retries, verdict.invalid, verdict.failed) == (1, 0, 0, [False] * 3)
        assert (pod.workdir / "grpo_flyte" / "judge.py").is_file()
    else:
        assert pod.outputs is None
        assert pod.error.error.message.startswith("the judge's rubric and the question take"), pod.error.error.message
        assert (pod.error.error.code, pod.error.error.kind) == ("NonRecoverableError", execution_pb2.ContainerError.NON_RECOVERABLE)


@pytest.mark.parametrize("label", ["right", None])
def test_reward_model_group_pod_scores_a_group_on_the_reward_model(rehearsal, tmp_path, embedded_dir, label):
    """The reward model's pod: the model comes in as a Dir (through the object store), the bundle
    brings grpo_flyte.judge and grpo_flyte.models.reward_model; one score per completion, each the
    probability of the label the reward names. A reward that names no label of a two-label model
    fails the pod, not retried (the CLI refuses it before start, a task called directly here)."""
    from tests.support.tiny_model import build_tiny_reward_model

    folder = build_tiny_reward_model(tmp_path / "rm", embedded_dir, num_labels=2)
    reward = f"{folder}@{label}" if label else str(folder)
    config = RunConfig(rewards={reward: 1.0})
    pod = rehearsal.run(reward_model_group, reward, config.prompt, config.scoring, _object_store(folder), GROUP)
    if label:
        assert pod.error is None, pod.log[-4000:]
        result = pod.outputs
        assert isinstance(result, RewardModelScores) and result.reward == reward and result.failed == [False] * 3
        assert all(0.0 < s < 1.0 for s in result.scores) and len(set(result.scores)) == 3
        assert (pod.workdir / "grpo_flyte" / "models" / "reward_model.py").is_file()
    else:
        assert pod.outputs is None
        assert "the model has 2 labels (0=wrong, 1=right)" in pod.error.error.message, pod.error.error.message
        assert (pod.error.error.code, pod.error.error.kind) == ("NonRecoverableError", execution_pb2.ContainerError.NON_RECOVERABLE)


# --------------------------------------------------------------------------- the data-parallel train step

DISTRIBUTED = "grpo_flyte-train-dist.train_step_distributed"


def _distributed_step() -> SimpleNamespace:
    """train_step_distributed as the driver submits it: train_step's inputs, an optional result (this
    process has one train GPU configured, so it declares no such task of its own)."""
    interface = dataclasses.replace(train_step.native_interface, outputs={"o0": TrainStepResult | None})
    return SimpleNamespace(name=DISTRIBUTED, native_interface=interface)


def _object_store(folder: Path | str) -> Dir:
    """A folder of this machine as an object-store Dir (`local://`): pods download it."""
    return Dir(path="local://" + str(folder).removeprefix("file://"))


def test_the_distributed_train_step_runs_under_the_plugins_launcher_in_two_processes(rehearsal, tiny_model_dir, adapter_v0, monkeypatch):
    """train_step_distributed through `a0` with flyteplugins-pytorch's own launcher: the plugin
    cloudpickles the task's function, torch's elastic agent spawns two processes (gloo), each
    imports grpo_flyte from the bundle (the image has none), they download the base and the
    adapter once between them, and rank 0 alone uploads the new adapter and answers for the task."""
    import torch

    monkeypatch.setattr(rehearsal, "raw_scheme", "local://")
    v0 = local_path(adapter_v0.outputs.dir.path)
    adapter = AdapterRef(version=0, dir=_object_store(v0))
    pod = rehearsal.run(
        _distributed_step(), CONFIG.base, CONFIG.lora, CONFIG.train, CONFIG.sampling, _object_store(tiny_model_dir), adapter,
        [scored_pair(0), scored_pair(1)],
    )  # fmt: skip
    assert pod.error is None, pod.log[-4000:]
    result = pod.outputs
    assert isinstance(result, TrainStepResult) and result.adapter.version == 1 and result.stats.world_size == 2
    assert (result.num_rollouts, result.stats.num_updates) == (4, 1) and result.stats.grad_norm > 0
    folder = local_path(result.adapter.dir.path)  # uploaded through the object store, under the pod's raw data
    assert result.adapter.dir.path.startswith("local://") and folder.is_relative_to(pod.raw_data)
    assert (folder / OPTIMIZER_FILE).is_file() and json.loads((folder / STATE_FILE).read_text()) == {"version": 1}
    before, after = _lora(v0), _lora(folder)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the pod's disk holds one copy of the base and one of the adapter, not one per process
    cache = pod.workdir / ".cache" / "grpo_flyte"
    assert [len(list(cache.rglob(name))) for name in ("model.safetensors", "adapter_model.safetensors")] == [1, 1]


def test_a_damaged_adapter_fails_the_distributed_step_not_retried(rehearsal, tiny_model_dir, tmp_path):
    """The plugin reports a failed process as a RuntimeError with exit codes only, which Flyte
    retries; the processes' input error (here both read a damaged adapter) must fail the task
    not retried, with the processes' own message."""
    damaged = tmp_path / "v0000"
    damaged.mkdir()
    (damaged / "adapter_model.safetensors").write_bytes(b"not safetensors")
    adapter = AdapterRef(version=0, dir=Dir(path=str(damaged)))
    pod = rehearsal.run(
        _distributed_step(), CONFIG.base, CONFIG.lora, CONFIG.train, CONFIG.sampling, Dir(path=tiny_model_dir.as_uri()), adapter,
        [scored_pair(0), scored_pair(1)],
    )  # fmt: skip
    assert pod.outputs is None, pod.log[-4000:]
    assert (pod.error.error.code, pod.error.error.kind) == ("NonRecoverableError", execution_pb2.ContainerError.NON_RECOVERABLE)
    assert pod.error.error.message.startswith(f"adapter {str(damaged)!r} cannot be loaded"), pod.error.error.message


# --------------------------------------------------------------------------- the warm replica


def _ok(results: list[tuple]) -> list:
    assert all(error is None for _, error in results), [error.error.message for _, error in results if error is not None]
    return [outputs for outputs, _ in results]


QUESTIONS = [Example(question=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(16)]


@pytest.fixture(scope="module")
def warm_replica(rehearsal, tiny_model_dir, embedded_dir, tmp_path_factory):
    """One replica process, the bundle loaded once, two runs of other base models on it, in turns:

    1. run 1: init_adapter on model A, then 16 generate actions at once, then three train_steps;
    2. run 2 (model B) interleaved with run 1: B's init_adapter beside one of A's generate calls,
       16 generate calls on B beside A's fourth step, B's first step, then A's fourth step again
       (after B's), and finally four of run 1's first generate calls again.

    Everything goes through the object-store stand-in (`local://`), so the replica downloads and
    uploads every folder as on a cluster. Returns what each action gave and the warm state after
    each batch of actions."""
    from tests.support.tiny_model import build_tiny_model

    model_b = build_tiny_model(tmp_path_factory.mktemp("tiny-b"), embedded_dir, seed=1)
    replica = Replica(rehearsal.root.parent / "replica-run", rehearsal.bin_dir, rehearsal.submission)
    parts = {}
    for name, folder in (("a", tiny_model_dir), ("b", model_b)):
        config = CONFIG.model_copy(update={"base": CONFIG.base.model_copy(update={"model": str(folder)})})
        parts[name] = (config, _object_store(folder))

    def generate_call(run: str, name: str, adapter: AdapterRef, i: int) -> Call:
        config, base = parts[name]
        args = (config.base, config.engine, config.prompt, config.sampling, config.episode, base, adapter, QUESTIONS[i], i, 100 + i)
        return Call(generate, run, args)

    def step_call(run: str, name: str, adapter: AdapterRef) -> Call:
        config, base = parts[name]
        return Call(
            train_step, run, (config.base, config.lora, config.train, config.sampling, base, adapter, [scored_pair(0), scored_pair(1)])
        )

    def init_call(run: str, name: str) -> Call:
        config, base = parts[name]
        return Call(init_adapter, run, (config.base, config.lora, config.seed, base))

    out: dict = {"states": {}}
    try:
        [v0], _ = replica.run([init_call("r1", "a")])
        v0 = _ok([v0])[0]
        results, out["states"]["generate"] = replica.run([generate_call("r1", "a", v0, i) for i in range(16)])
        out["groups"] = _ok(results)
        steps, adapter = [], v0
        for _ in range(3):
            [result], _ = replica.run([step_call("r1", "a", adapter)])
            steps.append(_ok([result])[0])
            adapter = steps[-1].adapter
        out["steps"] = steps
        [warm4], out["states"]["train"] = replica.run([step_call("r1", "a", adapter)])  # v3 -> v4, right after v3
        out["v4_warm"] = _ok([warm4])[0]
        # run 2, in turns with run 1
        [w0, _], _ = replica.run([init_call("r2", "b"), generate_call("r1", "a", adapter, 0)])
        w0 = _ok([w0])[0]
        results, out["states"]["run 2"] = replica.run(
            [*(generate_call("r2", "b", w0, i) for i in range(16)), step_call("r1", "a", adapter)]
        )
        *groups_b, v4_after_b_init = _ok(results)
        out["groups_b"], out["v4_after_b_init"] = groups_b, v4_after_b_init
        [w1], _ = replica.run([step_call("r2", "b", w0)])
        out["w1"] = _ok([w1])[0]
        [v4], _ = replica.run([step_call("r1", "a", adapter)])
        out["v4_after_b_step"] = _ok([v4])[0]
        results, out["states"]["end"] = replica.run([generate_call("r1", "a", v0, i) for i in range(4)])
        out["groups_again"] = _ok(results)
    finally:
        replica.close()
    out["log"] = replica.log()
    return out


def test_a_replica_builds_one_engine_per_model_and_batches_concurrent_calls(warm_replica):
    """16 generate actions at once on one replica: one engine build, and engine batches that hold
    several actions' groups. Run 2's model (a sweep's second base) is one more build; coming back
    to run 1's model builds nothing (the replica holds an engine per base, up to MAX_BASES)."""
    states = warm_replica["states"]
    a, b = (state["engine_builds"] for state in (states["generate"], states["run 2"]))
    assert len(a) == 1 and len(b) == 2 and b[0] == a[0] != b[1]  # one build per model, not one per call
    assert states["end"]["engine_builds"] == b  # back to model A: its engine is still warm
    batcher = states["generate"]["batcher"]
    assert batcher["submitted"] == 16 and batcher["batches"] < 16, batcher  # batches span concurrent actions
    assert [g.index for g in warm_replica["groups"]] == list(range(16))
    assert all(len(g.rollouts) == CONFIG.sampling.group_size for g in warm_replica["groups"] + warm_replica["groups_b"])


def test_consecutive_steps_of_a_run_go_on_from_the_warm_optimizer(warm_replica):
    """The trainer loads model A once for run 1's steps; the first step after init_adapter reads
    the adapter and optimizer state from the folder, every later consecutive step goes on from
    memory (restore_s exactly 0)."""
    first, *later = [*warm_replica["steps"], warm_replica["v4_warm"]]
    assert first.stats.restore_s > 0 and [s.stats.restore_s for s in later] == [0.0, 0.0, 0.0]
    assert [s.adapter.version for s in warm_replica["steps"]] == [1, 2, 3]
    assert len(warm_replica["states"]["train"]["trainer_loads"]) == 1


def test_interleaved_runs_get_the_results_they_would_alone(warm_replica):
    """Run 2 (model B) between run 1's actions: run 1's fourth step gives bit for bit the adapter it
    gave right after its third (after B's init_adapter and after B's step alike, read back from its
    folder instead of memory), and run 1's first generate calls give the same rollouts again."""
    import torch

    v4 = _lora(local_path(warm_replica["v4_warm"].adapter.dir.path))
    for name in ("v4_after_b_init", "v4_after_b_step"):
        result = warm_replica[name]
        assert result.stats.restore_s > 0  # the warm optimizer was run 2's: read from the folder
        again = _lora(local_path(result.adapter.dir.path))
        assert again.keys() == v4.keys() and all(torch.equal(again[k], v4[k]) for k in v4), name
    for first, again in zip(warm_replica["groups"][:4], warm_replica["groups_again"], strict=True):
        assert [r.completion_ids for r in again.rollouts] == [r.completion_ids for r in first.rollouts]
        assert [r.sampling_logprobs for r in again.rollouts] == [r.sampling_logprobs for r in first.rollouts]
    # run 2 trained on its own model
    w1 = json.loads((local_path(warm_replica["w1"].adapter.dir.path) / "adapter_config.json").read_text())
    assert w1["base_model_name_or_path"].endswith("tiny-b0") and warm_replica["w1"].adapter.version == 1
    # the trainer's models, one per base: loaded once each, however the runs' steps interleave
    a, b, *rest = warm_replica["states"]["end"]["trainer_loads"]
    assert a != b and rest == []


def test_a_replicas_caches_stay_bounded(warm_replica):
    """After two runs, two models and nine adapters: an engine per model, each with at most
    adapter_cache_size adapters, a trainer model per model, one batcher, and every download cache
    within its capacity, on disk too (evicted folders are deleted)."""
    state = warm_replica["states"]["end"]
    assert state["batchers"] == 1 and state["trainer_models"] == 2
    assert len(state["engine_adapters"]) == 2
    for loaded, most in state["engine_adapters"]:
        assert most == CONFIG.engine.adapter_cache_size and 1 <= loaded <= most
    for name, cache in state["caches"].items():
        assert cache["entries"] <= cache["capacity"] and cache["on_disk"] == cache["entries"], (name, cache)
    assert state["caches"]["rollout models"]["entries"] == state["caches"]["train models"]["entries"] == 2


# --------------------------------------------------------------------------- a sweep on one replica (issue 54)

SWEEP_RATES = [1e-3 * (i + 1) for i in range(10)]


def test_a_sweep_of_ten_configs_runs_to_its_end_with_their_generate_calls_on_one_replica(rehearsal, tiny_model_dir):
    """A sweep of 10 configs (learning_rate=...), two iterations each, every action on one warm
    replica through the object store (`local://` adapter paths, which the replica downloads): each
    iteration, all 10 configs' generate calls (two prompts each) at once, then their train steps on
    the groups scored, one at a time as the train pool runs them. Before issue 54's item 2, the replica kept 8 adapter folders and deleted one
    a call still needed past 8 configs; here every call succeeds, each config's adapter reaches v2,
    and every download cache stays within its bound."""
    from grpo_flyte.reward import score

    replica = Replica(rehearsal.root.parent / "replica-sweep", rehearsal.bin_dir, rehearsal.submission)
    base = _object_store(tiny_model_dir)
    configs = [CONFIG.model_copy(update={"train": CONFIG.train.model_copy(update={"learning_rate": lr})}) for lr in SWEEP_RATES]
    names = [f"lr-{i}" for i in range(len(configs))]
    try:
        adapters = _ok(replica.run([Call(init_adapter, n, (c.base, c.lora, c.seed, base)) for n, c in zip(names, configs, strict=True)])[0])
        assert len({a.dir.path for a in adapters}) == 10 and all(a.dir.path.startswith("local://") for a in adapters)
        for iteration in range(2):
            calls = [
                Call(generate, n, (c.base, c.engine, c.prompt, c.sampling, c.episode, base, a, QUESTIONS[k], k, 100 * iteration + k))
                for n, c, a in zip(names, configs, adapters, strict=True)
                for k in range(2)
            ]
            results, state = replica.run(calls)
            groups = _ok(results)
            assert [g.adapter_version for g in groups] == [iteration] * 20
            assert all(len(g.rollouts) == CONFIG.sampling.group_size for g in groups)
            # the train pool runs one step at a time (concurrency 1, envs.train_env): one action a batch
            trained = []
            for i, (n, c, a) in enumerate(zip(names, configs, adapters, strict=True)):
                scored = [score(c.scoring, c.sampling, g) for g in groups[2 * i : 2 * i + 2]]
                [result], state = replica.run([Call(train_step, n, (c.base, c.lora, c.train, c.sampling, base, a, scored))])
                trained.append(_ok([result])[0])
            adapters = [r.adapter for r in trained]
    finally:
        replica.close()
    assert [a.version for a in adapters] == [2] * 10
    assert len(state["engine_builds"]) == 1  # one base: one engine for the whole sweep
    for name, cache in state["caches"].items():
        assert cache["entries"] <= cache["capacity"] and cache["on_disk"] == cache["entries"], (name, cache)


def test_a_long_episode_group_crosses_the_score_group_pod_as_a_file(rehearsal, tmp_path):
    """Issue 54, item 7, from the pod's side: a group of about 450k tokens (more than Flyte's 10 MiB
    inline, flyte.models.MAX_INLINE_IO_BYTES), stowed as generate returns it, in the object store.
    The score_group pod reads it from there and scores its 8 episodes; its inputs.pb and
    outputs.pb, as the remote controller would check them, stay under 1 MiB, and the group it
    returns reads back whole."""
    from flyte.models import MAX_INLINE_IO_BYTES

    from grpo_flyte.runtime.storage import fetch_group, inline_size
    from tests.support.long_group import long_group, stowed_in_local_run

    big = long_group()
    assert inline_size(big) > MAX_INLINE_IO_BYTES
    [stub] = stowed_in_local_run([big], tmp_path / "raw")
    stub = stub.model_copy(update={"stowed": _object_store(stub.stowed.path)})
    config = RunConfig(rewards={"format": 1.0})
    pod = rehearsal.run(score_group, config.scoring, config.sampling, stub)
    assert pod.error is None, pod.log[-4000:]
    metadata = rehearsal.root / "metadata" / f"a{rehearsal.count}-score_group"
    assert max((metadata / name).stat().st_size for name in ("inputs.pb", "outputs.pb")) < 2**20
    scored = pod.outputs
    assert scored.group == stub and len(scored.rewards) == 8
    assert asyncio.run(fetch_group(scored.group)) == big


# --------------------------------------------------------------------------- tools and an agent from the bundle (issue 52)

# A team's code beside the package in the checkout's src/: a tool function, and an agent that
# calls the policy through the openai client and answers its tool calls with that function. The
# CLI imports the agent (and so the tools module) before submitting: both travel in the bundle.
TEAM_TOOLS = '''
from grpo_flyte.multiturn import evaluate, shown_number


def calculator(expression: str) -> str:
    """The team's calculator: the value of an arithmetic expression.

    Args:
        expression: Numbers, + - * / and parentheses, for example "374*829".
    """
    return shown_number(evaluate(expression))
'''
TEAM_AGENT = '''
import json

import openai

from grpo_flyte.multiturn import CALCULATOR_TOOLS_DEMO, CALCULATOR_TOOLS_SYSTEM
from team_tools import calculator

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "The team's calculator: the value of an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "for example 374*829"}},
                   "required": ["expression"]},
}}]


async def rollout(client, example):
    """Asks once, answers the reply's tool calls with the team's calculator, asks again; the reward
    is the number of calls answered, so that it shows the agent's own return value."""
    messages = [{"role": "system", "content": CALCULATOR_TOOLS_SYSTEM}, *(m.model_dump() for m in CALCULATOR_TOOLS_DEMO)]
    messages.append({"role": "user", "content": example.question})
    answered = 0
    for _ in range(2):
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError:
            break
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = calculator(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            answered += 1
    return float(answered)
'''
TEAM_MODULES = ("team_tools", "team_agent")


@pytest.fixture(scope="module")
def team_rehearsal(rehearsal, tiny_model_dir) -> Rehearsal:
    """The checkout submitted again, the team's modules now in its src/, with `--agent
    team_agent:rollout`: the CLI imports the agent (and the tools module it imports) before it
    submits, so both are in this bundle. The test's own process cannot import either."""
    checkout_src = rehearsal.root.parent / "checkout" / "src"
    (checkout_src / "team_tools.py").write_text(TEAM_TOOLS)
    (checkout_src / "team_agent.py").write_text(TEAM_AGENT)
    out = rehearsal.root.parent / "team-submission"
    out.mkdir()
    submission = run_submission(
        rehearsal.bin_dir, checkout_src, rehearsal.root.parent / "elsewhere", out, tiny_model_dir, "correct=1.0", {},
        ("--agent", "team_agent:rollout"),
    )  # fmt: skip
    return Rehearsal(rehearsal.root.parent / "team-run", rehearsal.bin_dir, submission)


# The embedded SmolLM2 (its template has no tools: the fallback format), which calls the tool after
# the worked exchange in the calculator_tools prompts (at temperature 0.1, in each episode); one
# question, two episodes of two turns.
TEAM_CONFIG = {
    "group_size": 2, "max_new_tokens": 40, "max_turns": 2, "max_episode_tokens": 128, "temperature": 0.1, "backend": "hf",
    "dtype": "float32", "lora_rank": 2,
}  # fmt: skip


@pytest.fixture(scope="module")
def embedded_v0(embedded_dir, tmp_path_factory) -> AdapterRef:
    """Version 0 of an adapter on the embedded model, written by init_adapter's own code (here, not in a pod)."""
    from grpo_flyte.learning import policy

    config = RunConfig(**TEAM_CONFIG)
    out = tmp_path_factory.mktemp("embedded-adapter") / "v0000"
    peft = policy.peft_model(config.base, config.lora, str(embedded_dir))
    policy.reset_lora(peft, config.seed)
    policy.save_adapter(peft, None, 0, out)
    policy.record_base(out, str(embedded_dir))
    policy._peft_model.cache_clear()
    return AdapterRef(version=0, dir=Dir(path=str(out)))


def _team_pod(team_rehearsal, embedded_dir, adapter, **episode):
    from grpo_flyte.multiturn import builtin_split

    config = RunConfig(**TEAM_CONFIG, **episode)
    example = builtin_split("calculator_tools", "eval")[0]
    base = Dir(path=embedded_dir.as_uri())
    pod = team_rehearsal.run(
        generate, config.base, config.engine, config.prompt, config.sampling, config.episode, base, adapter, example, 0, 11
    )
    assert pod.error is None, pod.log[-4000:]
    return pod, example


def test_the_team_submission_ships_the_agent_and_its_tools_module(team_rehearsal):
    files = set(team_rehearsal.submission["bundle"]["files"])
    assert {"team_agent.py", "team_tools.py", "grpo_flyte/rollout.py"} <= files
    assert all(importlib.util.find_spec(name) is None for name in TEAM_MODULES)  # only a pod has them


def test_a_generate_pod_plays_tool_episodes_with_the_tools_module_of_the_bundle(team_rehearsal, embedded_dir, embedded_v0):
    """`--tools team_tools:calculator` in the pod: its schema (from the bundle's module) in the prompt,
    the model's calls run in the pod's sandbox workers, which import the module from the bundle's
    folder, and the answers spliced into the episode's ids, masked from the loss."""
    from transformers import AutoTokenizer

    from grpo_flyte.loop.metrics import episode_metrics
    from grpo_flyte.multiturn import evaluate, shown_number

    pod, example = _team_pod(team_rehearsal, embedded_dir, embedded_v0, tools="team_tools:calculator")
    group = pod.outputs
    assert (group.example, group.adapter_version) == (example, 0) and (pod.workdir / "team_tools.py").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_dir))
    assert "The team's calculator" in tokenizer.decode(group.prompt_ids)  # the schema from the bundle's docstring
    assert len(group.rollouts) == 2
    for rollout in group.rollouts:
        episode = rollout.episode
        assert episode.tool_calls == 1 and (episode.tool_errors, episode.tool_malformed) == (0, 0), episode
        call, answer, *_ = episode.turns
        assert (call.role, answer.role) == ("model", "tool")
        arguments = json.loads(call.text.split("<tool_call>")[1].split("</tool_call>")[0])
        assert arguments["name"] == "calculator"
        assert answer.text == shown_number(evaluate(arguments["arguments"]["expression"]))  # computed in the pod's sandbox
        ids, mask, logprobs = rollout.completion_ids, rollout.model_mask, rollout.sampling_logprobs
        assert len(ids) == len(mask) == len(logprobs) and mask[0] and not all(mask)
        reply = [t for t, m in zip(ids, mask, strict=True) if not m]
        assert answer.text in tokenizer.decode(reply)  # the tool message's ids, out of the loss
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
        assert all(math.isfinite(lp) and lp <= 0 for lp, m in zip(logprobs, mask, strict=True) if m)
    metrics = episode_metrics(group.rollouts)
    assert (metrics["tool_calls"], metrics["tool_call_rate"], metrics["tool_errors"], metrics["tool_malformed"]) == (2, 1.0, 0, 0)


def test_a_generate_pod_plays_the_agents_episodes_with_the_agent_module_of_the_bundle(team_rehearsal, embedded_dir, embedded_v0):
    """`--agent team_agent:rollout` in the pod: the agent (imported from the bundle, with the tools
    module it imports) calls the policy through the in-process openai client; the model's tool
    calls are parsed into the replies, answered by the agent, and the episode's training sequence
    is the engine's ids, the agent's messages masked out."""
    from transformers import AutoTokenizer

    from grpo_flyte.loop.metrics import episode_metrics

    pod, example = _team_pod(team_rehearsal, embedded_dir, embedded_v0, agent="team_agent:rollout")
    group = pod.outputs
    assert (group.example, group.adapter_version) == (example, 0) and (pod.workdir / "team_agent.py").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_dir))
    assert len(group.rollouts) == 2
    for rollout in group.rollouts:
        episode = rollout.episode
        assert episode.tool_calls == 1 and episode.reward == 1.0 and episode.end != "agent_error", episode
        call, answer, *_ = episode.turns
        assert (call.role, answer.role) == ("model", "tool") and "<tool_call>" in call.text
        ids, mask, logprobs = rollout.completion_ids, rollout.model_mask, rollout.sampling_logprobs
        assert len(ids) == len(mask) == len(logprobs) and mask[0] and not all(mask)
        assert answer.text in tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert "The team's calculator" in tokenizer.decode(rollout.prompt_ids)  # the agent's tools=, rendered by the template
    metrics = episode_metrics(group.rollouts)
    assert (metrics["tool_calls"], metrics["tool_call_rate"]) == (2, 1.0)
