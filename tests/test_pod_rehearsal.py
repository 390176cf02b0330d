"""The leaf tasks run as pods: Flyte's own spec, code bundle, entrypoint (`a0`) and input/output files.

No cluster is reachable here, so each task is rehearsed the way a pod runs it (see
`pod_rehearsal`): the CLI's cluster path submits a checkout of this package as an offline dry run,
which builds the code bundle; each task's container args come from `flyte.extras.serialize_env`;
`a0` runs them in an empty folder with an interpreter that has every dependency but not grpo_flyte,
so the package can only come from the bundle. Data moves between pods only through the files
Flyte writes: inputs.pb, outputs.pb, error.pb and the raw data prefix.

The checkout is a copy of this worktree's package with a team's reward module in its src/ (so it
ships); a second reward module sits outside the checkout, importable where the CLI runs but not
shipped, the mistake the rehearsal has to catch.
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
from flyte.io import Dir
from flyteidl2.core import execution_pb2
from pod_rehearsal import RAW_SCHEMES, Rehearsal, image_python, local_path, run_submission
from tiny_model import scored_pair

from grpo_flyte.config import RunConfig
from grpo_flyte.judge import judge_group
from grpo_flyte.reward import score_group
from grpo_flyte.rollout import generate
from grpo_flyte.trainer import init_adapter, train_step
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE, Example, JudgeVerdict, Rollout, RolloutGroup, ScoredGroup

REWARD_MODULE = "def digits(completions, **kwargs):\n    return [float(sum(ch.isdigit() for ch in c)) for c in completions]\n"
SHIPPED, STRAY = "team_rewards:digits", "stray_rewards:digits"
PACKAGE = Path(__file__).resolve().parents[1]


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
    rewards = f"correct=1.0,{SHIPPED}=0.5"  # the CLI refuses STRAY before submitting (tests/test_submit.py)
    submission = run_submission(bin_dir, checkout / "src", root / "elsewhere", root / "submission", tiny_model_dir, rewards)
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
def test_init_adapter_then_two_train_step_pods_hand_the_adapter_on(rehearsal, base_model, raw_scheme, monkeypatch):
    """A shared file system (`file://`) and an object store (`local://`: uploads and downloads as with s3)."""
    import torch

    monkeypatch.setattr(rehearsal, "raw_scheme", raw_scheme)
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

    from grpo_flyte.prompts import tokenize_prompt

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
