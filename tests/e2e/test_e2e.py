"""End-to-end runs in Flyte local mode: tiny random model for speed, the embedded SmolLM2 once."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import flyte
import pytest
from flyte.io import Dir

from grpo_flyte import reward
from grpo_flyte.config.run import RunConfig
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning.policy import peft_model
from grpo_flyte.runtime import sandbox
from grpo_flyte.scoring import workers as reward_workers
from grpo_flyte.trainer import init_adapter, train_step
from grpo_flyte.types import AdapterRef, Example, RewardParts, Rollout, RolloutGroup, ScoredGroup, TrainStepResult
from tests.support.console import failed_run_lines
from tests.support.tiny_model import scored_pair

TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def lora_tensors(adapter_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def test_local_run_writes_every_file(tmp_path, tiny_model_dir, jsonl_dataset, caplog):
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), "--dataset", str(jsonl_dataset), "--iterations", "2"]
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main([*args, *TINY, "--run-dir", str(run_dir)]) == 0
    done = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("done: "))
    run_peak = float(re.search(r"; peak memory (\d+\.\d\d) GB resident \(this process and its children\)$", done).group(1))

    config = json.loads((run_dir / "config.json").read_text())
    assert config["iterations"] == 2 and config["sampling"]["group_size"] == 3  # saved in parts
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 0: the held-out evaluation before training
    assert [r["adapter_version"] for r in rows] == [0, 1, 2]
    required = {
        "mean_reward",
        "accuracy",
        "format_rate",
        "loss",
        "num_rollouts",
        "generate_s",
        "score_s",
        "train_s",
        "iteration_s",
        "kl",
        "clip_fraction",
        "is_ratio_mean",
        "is_ratio_max",
        "is_ess",
        "is_clipped_fraction",
        "entropy",
        "grad_norm",
        "frac_zero_std_groups",
        "completion_len_mean",
        "completion_len_max",
        "truncated_fraction",
        "generate_tokens_per_s",
        "score_tokens_per_s",
        "train_tokens_per_s",
        "train_world_size",
        "train_restore_s",
        "peak_rss_gb",
        "generate_peak_rss_gb",
        "score_peak_rss_gb",
        "train_peak_rss_gb",
    }
    evaluated = {"eval_reward", "eval_accuracy", "eval_format_rate", "eval_size", "eval_reward_ci95", "eval_s"}
    assert evaluated <= rows[0].keys() and "mean_reward" not in rows[0]
    for row in rows[1:]:
        assert required <= row.keys(), required - row.keys()
        assert row["num_rollouts"] == 2 * 3
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["format_rate"] <= 1
        assert row["iteration_s"] >= row["generate_s"] + row["train_s"] - 1e-6
        assert 0 <= row["frac_zero_std_groups"] <= 1 and 0 <= row["truncated_fraction"] <= 1
        assert row["completion_len_max"] <= 8  # --max-new-tokens 8
        # one process runs every task: the driver's tree over the iteration saw each task's readings
        stages = [row[f"{stage}_peak_rss_gb"] for stage in ("generate", "score", "train")]
        assert row["peak_rss_gb"] >= max(stages) and min(stages) > 0.1 and "train_peak_gpu_gb" not in row  # no GPU here
    assert rows[0]["peak_rss_gb"] > 0.1 and "train_peak_rss_gb" not in rows[0]
    assert run_peak >= round(max(row["peak_rss_gb"] for row in rows), 2) - 0.01  # the run's span holds every row's
    assert "eval_reward" not in rows[1] and evaluated <= rows[2].keys()  # eval_every 10: first and last only
    for iteration in (0, 2):
        answers = [json.loads(x) for x in (run_dir / "eval" / f"iter-{iteration:04d}.jsonl").read_text().splitlines()]
        assert len(answers) == 2 and {"question", "answer", "completion", "reward", "correct"} <= answers[0].keys()
        assert rows[iteration]["eval_reward"] == pytest.approx(sum(a["reward"] for a in answers) / 2)
    report = (run_dir / "report.html").read_text()
    assert "complete" in report and "<svg" in report and "Held-out evaluation" in report and "Entropy" in report
    # the latest evaluation's answers (eval size 2 here: both) and the stage times have their place
    assert report.count('<table class="kv held-out">') == 1 and "Seconds per stage" in report
    assert 'http-equiv="refresh"' not in report  # a finished run's report no longer reloads itself

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, run_dir / "adapter")
    assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == 2
    assert any("lora_A" in n for n, _ in model.named_parameters())


test_env = flyte.TaskEnvironment(name="grpo_flyte-test")
_snapshot: dict = {}


@test_env.task
async def init_then_step(config: RunConfig, base: Dir, scored: list[ScoredGroup]) -> tuple[AdapterRef, TrainStepResult]:
    """init_adapter, a snapshot of the base weights, then one train_step."""
    v0 = await init_adapter(config.base, config.lora, config.seed, base)
    model = peft_model(config.base, config.lora, base.path)
    _snapshot.update({n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n})
    return v0, await train_step(config.base, config.lora, config.train, config.sampling, base, v0, scored)


def test_train_step_changes_lora_but_not_base(tmp_path, tiny_model_dir):
    """One GRPO step on hand-made scored groups with varied rewards."""
    import torch

    config = RunConfig(model=str(tiny_model_dir), group_size=2, learning_rate=1e-2, dtype="float32", kl_monitor_every=1)

    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        init_then_step, config=config, base=Dir(path=str(tiny_model_dir)), scored=[scored_pair(0), scored_pair(1)]
    )
    snapshot = _snapshot
    v0, result = run.outputs()
    assert result.adapter.version == 1 and result.num_contributing == 4 and result.num_rollouts == 4
    stats = result.stats
    assert stats.num_tokens == 2 * (3 + 2)  # every completion token, EOS included
    assert stats.grad_norm > 0 and stats.num_updates == 1
    # v0 has lora_B = 0, so the policy is the reference exactly, and one update never clips
    assert stats.kl == 0.0 and stats.clip_fraction == 0.0
    # the hand-made sampling log-probs (-1.0) differ from the trainer's: the ratio is measured
    assert stats.is_ratio_max > 0 and stats.is_ratio_max != pytest.approx(1.0)
    assert stats.entropy > 0
    before, after = lora_tensors(Path(v0.dir.path)), lora_tensors(Path(result.adapter.dir.path))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before if "lora_B" in k)
    assert all(torch.equal(before[k], torch.zeros_like(before[k])) for k in before if "lora_B" in k)
    assert (Path(result.adapter.dir.path) / "optimizer.pt").is_file()
    model = peft_model(config.base, config.lora, str(tiny_model_dir))
    base_params = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    assert snapshot and base_params.keys() == snapshot.keys()
    assert all(not p.requires_grad for p in base_params.values())
    assert all(torch.equal(base_params[n].detach(), snapshot[n]) for n in snapshot)


def test_several_updates_per_iteration_clip_and_drift_from_the_reference(tmp_path, tiny_model_dir):
    config = RunConfig(
        model=str(tiny_model_dir),
        group_size=3,
        learning_rate=5e-2,
        dtype="float32",
        updates_per_iter=2,
        beta=0.1,
        epsilon=1e-4,
        epsilon_high=1e-4,
    )
    a = Rollout(completion_ids=[11, 12, 2], sampling_logprobs=[-1.0] * 3, finish_reason="stop", text="a")
    b = Rollout(completion_ids=[13, 2], sampling_logprobs=[-1.0] * 2, finish_reason="stop", text="b")
    right = RewardParts(reward=1.0, correct=True, format=False)
    wrong = RewardParts(reward=0.0, correct=False, format=False)
    groups = [
        ScoredGroup(
            group=RolloutGroup(
                index=i,
                example=Example(question="q", answer="1"),
                adapter_version=0,
                prompt_ids=[1, 5, 6, 7],
                rollouts=[a, b, a],
                generate_s=0.0,
            ),
            rewards=[right, wrong, right],
        )
        for i in range(2)
    ]
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        init_then_step, config=config, base=Dir(path=str(tiny_model_dir)), scored=groups
    )
    _, result = run.outputs()
    # Sequences a+ b- a+ a+ b- a+ are dealt into minibatches [a+ a+ b-] and [b- a+ a+]: two
    # optimizer steps. The first raises a's probability, so in the second the a+ tokens have a
    # ratio above 1 + epsilon_high (clipped), and the policy has left the reference (KL > 0).
    assert result.stats.num_updates == 2
    assert result.stats.kl > 0
    assert result.stats.clip_fraction > 0


def test_resume_extends_a_finished_run(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    common = ["--local", "--model", str(tiny_model_dir), *TINY, "--run-dir", str(run_dir)]
    assert cli_main([*common, "--iterations", "1"]) == 0
    first_adapter = lora_tensors(run_dir / "adapter")
    assert cli_main([*common, "--iterations", "3", "--resume"]) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert [r["adapter_version"] for r in rows] == [0, 1, 2, 3]
    # evaluated before training, at the end of the first run, and at the end of the extension
    assert [r["iteration"] for r in rows if "eval_reward" in r] == [0, 1, 3]
    assert json.loads((run_dir / "config.json").read_text())["iterations"] == 3
    assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == 3
    assert lora_tensors(run_dir / "adapter").keys() == first_adapter.keys()


# Rows as users write them by hand: a byte-order mark, CRLF line ends, blank lines, a duplicate
# row, and answers in forms the `correct` reward must read (1e3, -0, Arabic-Indic digits).
SMALL_ROWS = [
    {"question": "What is 10 to the power 3?", "answer": "1e3"},
    {"question": "What is 2 - 2?", "answer": "-0"},
    {"question": "What is 1 + 2?", "answer": "\u0663"},
    {"question": "What is 4 + 4?", "answer": 8},
]


def write_small_dataset(path: Path, rows: list[dict]) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join([*lines, lines[-1]]).encode() + b"\r\n")
    return path


@pytest.mark.parametrize("eval_size", [0, 1, 2, 3])
def test_every_small_held_out_size_finishes_exports_and_resumes(tmp_path, tiny_model_dir, eval_size, caplog):
    """One held-out question has no interval: the run must still finish, export and resume."""
    data, run_dir = write_small_dataset(tmp_path / "small.jsonl", SMALL_ROWS), tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), "--dataset", str(data), *TINY, "--eval-size", str(eval_size)]
    assert cli_main([*args, "--iterations", "1", "--run-dir", str(run_dir)]) == 0
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert cli_main([*args, "--iterations", "2", "--run-dir", str(run_dir), "--resume"]) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == ([0, 1, 2] if eval_size else [1, 2])
    evals = [r for r in rows if "eval_reward" in r]
    assert len(evals) == (3 if eval_size else 0) and all(r["eval_size"] == eval_size for r in evals)
    assert all(("eval_reward_ci95" in r) == (eval_size > 1) for r in evals)
    out = caplog.text
    assert ("(one question: no interval)" in out) == (eval_size == 1)
    assert "1 duplicate prompts dropped" in out
    assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == 2


def test_a_three_row_trl_dataset_runs_end_to_end_and_resumes(tmp_path, tiny_model_dir):
    """TRL's `prompt` column, in text and chat form in one file, with one held-out row."""
    rows = [
        {"prompt": "What is 1 + 1?", "answer": "2"},
        {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 3?"}], "answer": "6"},
    ]
    data, run_dir = write_small_dataset(tmp_path / "trl.jsonl", rows), tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), "--dataset", str(data), *TINY, "--eval-size", "1", "--run-dir", str(run_dir)]
    assert cli_main([*args, "--iterations", "1"]) == 0
    assert cli_main([*args, "--iterations", "2", "--resume"]) == 0
    assert [r["iteration"] for r in read_metrics(run_dir)] == [0, 1, 2]
    answers = [json.loads(line) for line in (run_dir / "eval" / "iter-0002.jsonl").read_text().splitlines()]
    assert len(answers) == 1 and answers[0]["question"] in {"What is 1 + 1?", "What is 2 + 3?", "What is 3 + 3?"}
    # the default evaluation is greedy: one answer a question, correct or not (no sampled completions)
    assert "completions" not in answers[0] and isinstance(answers[0]["correct"], bool)


def test_resume_rejects_a_changed_config(tmp_path, tiny_model_dir, capsys):
    run_dir = tmp_path / "run"
    common = ["--local", "--model", str(tiny_model_dir), *TINY, "--run-dir", str(run_dir)]
    assert cli_main([*common, "--iterations", "1"]) == 0
    before = (run_dir / "metrics.jsonl").read_text()
    assert cli_main([*common, "--resume", "--learning-rate", "0.5"]) == 2
    assert "--learning-rate" in capsys.readouterr().err
    assert cli_main([*common, "--iterations", "2"]) == 2  # a second run into the same folder
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_sigkill_mid_run_then_resume_records_each_iteration_once(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "6", "--run-dir", str(run_dir)]
    proc = subprocess.Popen([sys.executable, "-m", "grpo_flyte.driver", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 2:  # eval row + iteration 1
            time.sleep(0.3)  # into iteration 2: its generate and train tasks are in flight
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished or died before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(read_metrics(run_dir)) - 1
    assert 1 <= killed_at < 6

    assert cli_main([*args, "--resume"]) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    versions = [r["adapter_version"] for r in rows]
    assert versions == sorted(set(versions)) and versions[0] == 0
    assert json.loads((run_dir / "adapter" / "grpo_state.json").read_text())["version"] == versions[-1]
    # Old adapter versions are pruned (adapters_to_keep=3 by default), but the best one (v0: the tiny
    # random model's held-out reward never rises above the start's, and a tie is no new best).
    kept = sorted(p.name for p in (run_dir / "flyte" / "adapters").iterdir() if not p.name.startswith("."))
    assert kept == ["v0000", "v0004", "v0005", "v0006"]
    assert {r["best_iteration"] for r in rows if "eval_reward" in r} == {0}
    # and the final adapter loads
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run_dir / "adapter")
    assert any("lora_B" in n for n, _ in model.named_parameters())


def test_export_merged_loads_without_peft_and_matches_the_adapter(tmp_path, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--iterations",
        "2",
        "--learning-rate",
        "0.05",
        "--dtype",
        "float32",
        "--export-merged",
        "--export-adapter",  # the final adapter, whatever the evaluations said (the tiny model never beats its start)
        "final",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) == 0
    merged_dir = run_dir / "merged"
    assert (merged_dir / "config.json").is_file() and not (merged_dir / "adapter_config.json").exists()
    # checked against the adapter on the held-out set (float32: every answer alike), as the export command writes it
    check = json.loads((merged_dir / "export.json").read_text())
    assert (check["form"], check["path"], check["adapter"], check["adapter_iteration"]) == ("merged", str(merged_dir), "final", 2)
    assert check["agreement"] == 1.0 and check["difference"] == 0.0 and check["failure"] is None
    assert (merged_dir / "generation_config.json").is_file()  # the base's serving files, as `export --to merged` writes them
    assert not list((run_dir / "flyte" / "adapters").glob("merged-*"))  # moved, not copied
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), run_dir / "adapter"
    ).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(ids).logits
        want, got = adapted(ids).logits, merged(ids).logits
    assert torch.allclose(got, want, atol=1e-4)  # the merged folder is the adapted model, without PEFT
    assert base_logits.shape == got.shape
    tok = AutoTokenizer.from_pretrained(merged_dir)
    out = merged.generate(**tok("What is 1 + 1?", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > 0


def test_merge_into_base_applies_a_trained_adapter(tmp_path, tiny_model_dir):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_flyte.learning.merge import merge_into_base

    torch.manual_seed(0)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    ).eval()
    with torch.no_grad():  # a "trained" adapter: lora_B is zero at init, so give it values
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft.save_pretrained(tmp_path / "adapter")
    merge_into_base(str(tiny_model_dir), str(tmp_path / "adapter"), tmp_path / "merged")

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want, got, before = peft(ids).logits, merged(ids).logits, base(ids).logits
    assert not torch.allclose(want, before, atol=1e-3)  # the adapter changes the model
    assert torch.allclose(got, want, atol=1e-4)  # and the merged weights carry that change
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    base_saved = json.loads((tiny_model_dir / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) == base_saved.get("dtype", base_saved.get("torch_dtype"))


@pytest.mark.parametrize("prompt_format", ["chat", "plain"])
def test_trainer_sees_exactly_the_generators_token_ids(tmp_path, tiny_model_dir, prompt_format):
    """generate -> build_sequences -> the padded training batch: the same ids, never re-tokenized."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_flyte.engine import batching, cache
    from grpo_flyte.engine.cache import EngineKey
    from grpo_flyte.engine.interface import sampling_request
    from grpo_flyte.engine.prompts import render_prompt
    from grpo_flyte.learning.grpo import pad_batch
    from grpo_flyte.learning.update import build_sequences

    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    ).save_pretrained(tmp_path / "adapter")
    config = RunConfig(
        model=str(tiny_model_dir), group_size=3, max_new_tokens=6, prompt_format=prompt_format, dtype="float32", truncated="keep"
    )  # 6 tokens: most completions are cut off
    example = Example(question="What is 12 + 30?", answer="42")
    key = EngineKey("hf", str(tiny_model_dir), "float32", 4, 0, 0)

    async def generate_one():
        [prompt_ids] = await cache.tokenize(key, [example], config.prompt)
        request = sampling_request(config.sampling, prompt_ids, seed=5)
        [rollouts] = await batching.generate_groups(key, str(tmp_path / "adapter"), [request])
        return prompt_ids, rollouts

    prompt_ids, rollouts = asyncio.run(generate_one())

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = render_prompt(example.question, prompt_format, tokenizer)
    assert prompt_ids == tokenizer(text, add_special_tokens=prompt_format == "plain")["input_ids"]
    if prompt_format == "chat":
        assert tokenizer.decode(prompt_ids) == text  # the template's own special tokens, nothing added

    group = RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=prompt_ids, rollouts=rollouts, generate_s=0.0)
    parts = [RewardParts(reward=r, correct=False, format=False) for r in (0.0, 1.0, 3.0)]  # no reward at the mean
    sequences, total = build_sequences([ScoredGroup(group=group, rewards=parts)], config.train)
    assert total == 3 and len(sequences) == sum(1 for r in rollouts if r.completion_ids)
    batch = pad_batch(sequences, pad_id=0)
    for row, (seq, rollout) in enumerate(zip(sequences, [r for r in rollouts if r.completion_ids], strict=True)):
        assert seq.prompt_ids == prompt_ids and seq.completion_ids == rollout.completion_ids
        assert seq.sampling_logprobs == rollout.sampling_logprobs
        n = len(prompt_ids) + len(rollout.completion_ids)
        assert batch.input_ids[row, :n].tolist() == prompt_ids + rollout.completion_ids
        # the positions that predict completion tokens target exactly the generated ids
        assert batch.targets[row][batch.predict_mask[row]].tolist() == rollout.completion_ids


def test_top_up_adds_bounded_fresh_groups(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--iterations",
        "1",
        "--eval-size",
        "0",
        "--min-informative-groups",
        "2",
        "--max-topup-rounds",
        "1",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) == 0
    (row,) = read_metrics(run_dir)  # --eval-size 0: no evaluation rows
    assert row["num_groups"] == 2 + row["topup_groups"] and row["num_rollouts"] == 3 * row["num_groups"]
    informative_total = round(row["num_groups"] * (1 - row["frac_zero_std_groups"]))
    # a random tiny model rarely earns any reward, so the first round lacks informative groups;
    # one round at most tops up what was missing and no more
    assert 0 <= row["topup_groups"] <= 2
    assert row["topup_groups"] > 0 or informative_total >= 2
    assert not (run_dir / "eval").exists()


@pytest.mark.slow
def test_embedded_model_short_run(tmp_path, embedded_dir):
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--iterations",
        "1",
        "--prompts-per-iter",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "24",
        "--min-informative-groups",
        "0",
    ]
    assert cli_main([*args, "--eval-size", "4", "--run-dir", str(run_dir)]) == 0
    before, row = read_metrics(run_dir)
    assert row["num_rollouts"] == 4 and row["adapter_version"] == 1
    assert before["eval_size"] == row["eval_size"] == 4
    # A real instruct model writes text, not noise: the report shows one of its completions.
    report = (run_dir / "report.html").read_text()
    assert "What is" in report
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


# --------------------------------------------------------------------------- real tasks (issue 4)

REPO = Path(__file__).resolve().parents[2]
GSM8K_SAMPLE = REPO / "examples" / "data" / "gsm8k_sample.jsonl"
CUSTOM = "examples.custom_reward:shows_work"


def test_gsm8k_file_with_weighted_and_custom_rewards_reports_each_and_exports(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.syspath_prepend(str(REPO))  # examples.custom_reward imports from the repository root
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(GSM8K_SAMPLE),
        "--prompt-format",
        "chat",
        "--rewards",
        f"correct=1.0,format=0.2,{CUSTOM}=0.3",
        *TINY,
        "--eval-size",
        "4",
        "--iterations",
        "2",
        "--export-merged",
        "--export-adapter",
        "final",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) == 0
    rows = read_metrics(run_dir)
    names = ("correct", "format", CUSTOM)
    for row in rows[1:]:
        # each reward is its own metric, and the reward is their weighted sum
        assert {f"reward/{n}" for n in names} <= row.keys() and row["reward_errors"] == 0
        weighted = row["reward/correct"] + 0.2 * row["reward/format"] + 0.3 * row[f"reward/{CUSTOM}"]
        assert row["mean_reward"] == pytest.approx(weighted)
    assert {f"eval_reward/{n}" for n in names} <= rows[0].keys() and rows[0]["eval_size"] == 4
    answers = [json.loads(x) for x in (run_dir / "eval" / "iter-0002.jsonl").read_text().splitlines()]
    gold = {json.loads(x)["question"]: json.loads(x)["answer"].rsplit("####", 1)[1].strip() for x in GSM8K_SAMPLE.read_text().splitlines()}
    assert all(a["answer"] == gold[a["question"]] for a in answers)  # the gold answer is the text after ####
    assert all(set(a["scores"]) == set(names) for a in answers)
    report = (run_dir / "report.html").read_text()
    for n in names:
        assert f"Reward &#x27;{n}&#x27; (mean score)" in report

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged")
    tok = AutoTokenizer.from_pretrained(run_dir / "merged")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = merged.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 5 or tok.eos_token_id in out[0].tolist()


def _failing_reward_module(tmp_path: Path, monkeypatch) -> str:
    (tmp_path / "fragile_reward.py").write_text(
        "def judge(completions, **kwargs):\n"
        "    if len(completions) == 1:\n"
        "        raise ValueError('cannot judge this one')\n"
        "    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fragile_reward:judge"


def test_a_failing_reward_fails_the_run_naming_it_and_the_completion(tmp_path, tiny_model_dir, monkeypatch, caplog):
    name = _failing_reward_module(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--eval-size",
        "2",
        "--iterations",
        "1",
        "--rewards",
        f"correct=1,{name}=1",
        "--run-dir",
        str(run_dir),
    ]
    with caplog.at_level("ERROR", logger="grpo_flyte"):
        assert cli_main(args) == 1
    failure = "\n".join(r.getMessage() for r in caplog.records)
    # the evaluation before training scores one completion per question: the reward raises there
    assert f"reward '{name}' raised ValueError: cannot judge this one on completion 1 of 1, which starts" in failure
    # bad input: the resume hint says a resume meets the same failure until it is fixed
    assert (
        f"no iteration had finished; the traceback is in {run_dir / 'run.log'}; the failure comes from the run's input (below)" in failure
    )
    assert caplog.records[-1].getMessage().startswith(f"run failed: reward '{name}' raised ValueError")
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)
    assert "failed" in (run_dir / "report.html").read_text()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return [10**5000] * len(completions)", "returned an integer of about 5001 digits; expected a number that fits a float"),
        ("return (x for x in [1.0] * len(completions))", "raised TypeError: returned a value that cannot be sent back"),
        ("raise SystemExit(3)", "raised SystemExit: 3"),
    ],
)
def test_a_reward_failure_is_the_consoles_last_line_and_alone(tmp_path, tiny_model_dir, body, message):
    """What a user sees in the terminal: Flyte's warnings, then the one line that matters last,
    with no traceback on the console; the traceback is in run.log, which the line before names."""
    (tmp_path / "odd_reward.py").write_text(f"def odd(completions, **kwargs):\n    {body}\n")
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "1", "--rewards", "odd_reward:odd=1", "--run-dir", str(run_dir)]  # fmt: skip
    lines = failed_run_lines(args, import_from=tmp_path)
    assert f"run failed: reward 'odd_reward:odd' {message}" in lines[-1]
    assert f"the traceback is in {run_dir / 'run.log'}" in lines[-2]
    assert len(lines) < 12, lines
    assert "Traceback" in (run_dir / "run.log").read_text()


def test_rewards_that_write_to_stdout_below_python_score_normally_and_the_run_finishes(tmp_path, tiny_model_dir, monkeypatch, capfd):
    # a checker run as a subprocess, a C library's printf (os.write on fd 1), and megabytes of print
    (tmp_path / "chatty_reward.py").write_text(
        "import os, subprocess\n\n"
        "def judge(completions, **kwargs):\n"
        "    subprocess.run(['echo', 'checker says hello'], check=True)\n"
        "    os.write(1, b'printf from C\\n')\n"
        "    print('z' * (2 << 20))\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward_workers._workers.stop()  # a worker started by an earlier test writes to the stderr it started with, not capfd's
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "1", "--rewards", "correct=1,chatty_reward:judge=1"]
    assert cli_main([*args, "--run-dir", str(run_dir)]) == 0
    rows = read_metrics(run_dir)
    assert [row["iteration"] for row in rows] == [0, 1]
    assert "reward/chatty_reward:judge" in rows[1]
    err = capfd.readouterr().err  # docs/rewards-and-environments.md: a reward's own output goes to standard error
    assert "checker says hello" in err and "printf from C" in err


def test_the_reward_workers_start_together_before_the_first_group_is_scored(tmp_path, tiny_model_dir, monkeypatch):
    """The workers a run scores with (one per group scored at once: here a round's 3 prompts) all
    start as the run starts, side by side, and none inside an iteration: a worker imports
    math-verify (about a second) before its first call, which made the first iteration's scoring
    slow. (A pool of its own, no worker of an earlier test in it, of 3: `--reward-workers 3`.)"""
    pool = sandbox.WorkerPool(3, preload=("math_verify", reward_workers.__name__))
    monkeypatch.setattr(reward_workers, "_workers", pool)
    events = []
    real_launch, real_score = sandbox.Worker._launch, reward.score

    def launch(worker):
        started = real_launch(worker)
        if started:
            events.append("worker started")
        return started

    def score(*args):
        events.append("group scored")
        return real_score(*args)

    monkeypatch.setattr(sandbox.Worker, "_launch", launch)
    monkeypatch.setattr(reward, "score", score)
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--prompts-per-iter", "3", "--iterations", "2", "--reward-workers", "3"]
    assert cli_main([*args, "--run-dir", str(tmp_path / "run")]) == 0
    pool.stop()
    assert events[:3] == ["worker started"] * 3
    assert events.count("worker started") == 3 and events.count("group scored") >= 3 * 2


def test_on_reward_error_zero_scores_failures_0_and_counts_them(tmp_path, tiny_model_dir, monkeypatch):
    name = _failing_reward_module(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--eval-size",
        "2",
        "--iterations",
        "1",
        "--rewards",
        f"correct=1,{name}=1",
        "--on-reward-error",
        "zero",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) == 0
    rows = read_metrics(run_dir)
    assert rows[0]["eval_reward_errors"] == 2  # both held-out answers, scored alone, failed
    assert rows[1]["reward_errors"] == 0  # groups of 3: the batch call works
    assert "Reward errors (scored 0)" in (run_dir / "report.html").read_text()


def _held_out_rows(run_dir: Path, iteration: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval" / f"iter-{iteration:04d}.jsonl").read_text().splitlines()]


def test_a_sampled_held_out_evaluation_scores_each_question_by_its_completions_and_resumes(tmp_path, tiny_model_dir, monkeypatch):
    """--num-generations-eval 3: every held-out question gets 3 sampled completions, its reward and
    correctness are their means, the held-out figures the means over the questions; the same seed
    samples the same evaluation, another seed another; a resumed run goes on sampling."""
    (tmp_path / "spread_reward.py").write_text("def spread(completions, **kwargs):\n    return [len(c) % 4 / 3 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--num-generations-eval",
        "3",
        "--rewards",
        "correct=1,spread_reward:spread=1",
    ]
    run_dir = tmp_path / "run"
    assert cli_main([*args, "--iterations", "1", "--run-dir", str(run_dir)]) == 0
    assert cli_main([*args, "--iterations", "2", "--run-dir", str(run_dir), "--resume"]) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows if "eval_reward" in r] == [0, 1, 2]
    for row in rows:
        answers = _held_out_rows(run_dir, row["iteration"])
        assert len(answers) == 2 and all(len(a["completions"]) == 3 for a in answers)
        for a in answers:
            done = a["completions"]
            assert a["completion"] == done[0]["completion"]
            assert a["reward"] == pytest.approx(sum(c["reward"] for c in done) / 3)
            assert a["correct"] == pytest.approx(sum(c["correct"] for c in done) / 3)
            assert a["format"] == pytest.approx(sum(c["format"] for c in done) / 3)
            assert a["scores"]["spread_reward:spread"] == pytest.approx(sum(c["scores"]["spread_reward:spread"] for c in done) / 3)
            assert all(c["reward"] == pytest.approx(c["scores"]["correct"] + c["scores"]["spread_reward:spread"]) for c in done)
        assert row["eval_reward"] == pytest.approx(sum(a["reward"] for a in answers) / 2)
        assert row["eval_accuracy"] == pytest.approx(sum(a["correct"] for a in answers) / 2)
        assert row["eval_size"] == 2
    sampled = [c["completion"] for a in _held_out_rows(run_dir, 0) for c in a["completions"]]
    assert len(set(sampled)) > 1  # sampled, not one greedy answer repeated
    # the spread reward takes several values: the means above are not all of equal numbers
    assert len({c["reward"] for i in (0, 1, 2) for a in _held_out_rows(run_dir, i) for c in a["completions"]}) > 1
    # the evaluation before training is a function of the seed: the same seed samples it again, another seed not
    again, other = tmp_path / "again", tmp_path / "other"
    assert cli_main([*args, "--iterations", "1", "--eval-every", "0", "--run-dir", str(again)]) == 0
    assert _held_out_rows(again, 0) == _held_out_rows(run_dir, 0)
    assert cli_main([*args, "--iterations", "1", "--seed", "1", "--run-dir", str(other)]) == 0
    assert [a["completions"] for a in _held_out_rows(other, 0)] != [a["completions"] for a in _held_out_rows(run_dir, 0)]


def _wandb_history(run_dir: Path) -> tuple[str, list[dict]]:
    """The run id and logged rows of an offline W&B run, read from its .wandb file.

    The file is a LevelDB-style log (a 7-byte header, then 32 KiB blocks of records, each with a
    7-byte header: crc, length, type) of wandb's protobuf Records.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, records, buf = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(buf)
            buf = b""
    run_id, rows = "", []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return run_id, rows


def test_wandb_offline_gets_the_same_metrics_rows(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = [
        "--local",
        "--model",
        str(tiny_model_dir),
        *TINY,
        "--iterations",
        "2",
        "--wandb-project",
        "grpo-test",
        "--run-dir",
        str(run_dir),
    ]
    assert cli_main(args) == 0
    run_id, logged = _wandb_history(run_dir)
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in logged] == [r["iteration"] for r in rows] == [0, 1, 2]
    for got, want in zip(logged, rows, strict=True):
        assert got["mean_reward" if "mean_reward" in want else "eval_reward"] == pytest.approx(
            want["mean_reward" if "mean_reward" in want else "eval_reward"]
        )
        assert got["_step"] == want["iteration"]
    assert len(run_id) == 12
    # each held-out evaluation also logs its answers as a table, at the same step
    # (the history record holds the table's reference as nested keys: held_out_answers/path, ...)
    tables = {
        r["iteration"]: {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("held_out_answers/")}
        for r in logged
        if "held_out_answers/path" in r
    }
    assert sorted(tables) == [0, 2] and all(t["_type"] == "table-file" and t["nrows"] == 2 for t in tables.values())
    (files,) = run_dir.glob("wandb/offline-run-*/files")
    table = json.loads((files / tables[2]["path"]).read_text())
    answers = [json.loads(x) for x in (run_dir / "eval" / "iter-0002.jsonl").read_text().splitlines()]
    assert table["columns"] == ["question", "answer", "completion", "reward", "correct"]
    assert [row[2] for row in table["data"]] == [a["completion"] for a in answers]


def test_trackio_mlflow_and_tensorboard_get_the_metrics_rows_and_a_resume_continues_them(tmp_path, tiny_model_dir, monkeypatch):
    """A local run logs to the three trackers offline, then a resume extends it; each tracker's own
    reader finds every number of metrics.jsonl under its key at step = iteration, once, in one
    tracker run, and the completions sample (--log-completions) where the tracker has tables."""
    import mlflow
    import trackio
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio import sqlite_storage

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")  # read at trackio's import
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--run-dir", str(run_dir), "--report-to", "trackio,mlflow,tensorboard"]
    args += ["--log-completions", "--num-completions-to-log", "4", "--tracking-project", "grpo-test"]
    assert cli_main([*args, "--iterations", "2"]) == 0
    assert cli_main([*args, "--iterations", "3", "--resume"]) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert "failed on attempt" not in (run_dir / "run.log").read_text()  # no tracker failed the driver
    # every number of every row, by key: [(step, value)]
    want: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                want.setdefault(key, []).append((row["iteration"], float(value)))
    assert {"mean_reward", "eval_reward", "loss", "reward/correct", "eval_reward/correct"} <= set(want)
    samples = {i: [json.loads(x) for x in (run_dir / "completions" / f"iter-{i:04d}.jsonl").read_text().splitlines()] for i in (1, 2, 3)}
    assert sorted(p.name for p in (run_dir / "completions").iterdir()) == ["iter-0001.jsonl", "iter-0002.jsonl", "iter-0003.jsonl"]
    assert all(len(s) == 4 and {c["iteration"] for c in s} == {i} for i, s in samples.items())
    assert [c["group"] for c in samples[3]] == [0, 0, 0, 1]  # --group-size 3: the first group whole, then the next
    assert "Completions of iteration 3" in (run_dir / "report.html").read_text()

    # MLflow: one run (found again by its tag on resume) in the run folder's file store
    client = mlflow.MlflowClient((run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("grpo-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["iterations"] == "2"  # the params it started with
    for key, points in want.items():  # the file store writes a key's '/' as '.'
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key.replace("/", ".")))
        assert history == [(step, pytest.approx(value)) for step, value in points], key
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "completions/iter-0003.json", str(tmp_path))).read_text())
    assert table["columns"] == ["group", "question", "answer", "completion", "reward", "advantage"]
    assert [r[3] for r in table["data"]] == [c["completion"] for c in samples[3]]
    assert [r[5] for r in table["data"]] == pytest.approx([c["advantage"] for c in samples[3]])

    # TensorBoard: an event file per attempt, read as one run; 32-bit floats
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(want)
    for key, points in want.items():
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], key

    # trackio: one run in the project, named by the tracking id, continued on resume
    (name,) = sqlite_storage.SQLiteStorage.get_runs("grpo-test")
    logs = sqlite_storage.SQLiteStorage.get_logs("grpo-test", name)
    for key, points in want.items():
        got = [(log["step"], log[key]) for log in logs if key in log]
        assert got == [(step, pytest.approx(value)) for step, value in points], key
    tables = {log["step"]: log["completions"]["_value"] for log in logs if "completions" in log}
    assert sorted(tables) == [1, 2, 3] and [r["completion"] for r in tables[2]] == [c["completion"] for c in samples[2]]
    assert sqlite_storage.SQLiteStorage.get_run_config("grpo-test", name)["report_to"] == ["trackio", "mlflow", "tensorboard"]
    assert trackio  # imported above with TRACKIO_DIR set, if first


def test_the_curriculum_example_drives_the_tasks_from_a_user_workflow(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.my_loop import STAGES, curriculum

    config = RunConfig(prompts_per_iter=4, group_size=2, max_new_tokens=4, eval_size=0)
    run = flyte.with_runcontext(mode="local").run(curriculum, base_model=Dir(path=str(tiny_model_dir)), config=config)
    adapter = run.outputs()[0]
    assert adapter.version == len(STAGES)  # one train_step per stage
    printed = capsys.readouterr().out
    assert "stage 1: accuracy" in printed and f"adapter v{len(STAGES)}" in printed


# --------------------------------------------------------------------------- failure drills (issue 5)


def test_transient_failures_in_generate_and_train_step_are_retried(tmp_path, tiny_model_dir, monkeypatch):
    """The test injects one transient failure into generate and one into train_step; Flyte's task
    retries (retries=2) finish the run. The failing train_step had already written its new adapter
    (half-published): nothing of it is left."""
    from grpo_flyte.engine import batching
    from grpo_flyte.learning import policy

    generate_failures: list[str] = []
    original_generate_groups = batching.generate_groups

    async def flaky_generate_groups(*args, **kwargs):
        # the generate task's engine call: the first one fails before it generates anything
        if not generate_failures:
            generate_failures.append("generate_groups")
            raise RuntimeError("injected transient failure in generate_groups")
        return await original_generate_groups(*args, **kwargs)

    train_failures: list[int] = []
    original_save_adapter = policy.save_adapter

    def flaky_save_adapter(model, optimizer, version, out, *rest):
        # the new adapter is written, then the task fails: a failure with the adapter half-published.
        # Version 0 is init_adapter's; the drill is about train_step, so its first save fails.
        original_save_adapter(model, optimizer, version, out, *rest)
        if version > 0 and not train_failures:
            train_failures.append(version)
            raise RuntimeError(f"injected transient failure after save_adapter of v{version}")

    monkeypatch.setattr(batching, "generate_groups", flaky_generate_groups)
    monkeypatch.setattr(policy, "save_adapter", flaky_save_adapter)
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--eval-size", "0", "--iterations", "2", "--run-dir", str(run_dir)]
    assert cli_main(args) == 0
    assert (generate_failures, train_failures) == (["generate_groups"], [1])  # each fired, once
    rows = read_metrics(run_dir)
    assert [(r["iteration"], r["adapter_version"], r["num_rollouts"]) for r in rows] == [(1, 1, 6), (2, 2, 6)]
    # the failed train_step attempt had written its adapter into a staging folder: nothing of it is left
    adapters = run_dir / "flyte" / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == ["v0000", "v0001", "v0002"]


@pytest.mark.parametrize("damaged", ["adapter_model.safetensors", "optimizer.pt"])
def test_resume_from_a_corrupt_adapter_fails_naming_it_and_writes_nothing(tmp_path, tiny_model_dir, caplog, damaged):
    from grpo_flyte.types import OPTIMIZER_FILE

    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--eval-size", "0", "--iterations", "1", "--run-dir", str(run_dir)]
    assert cli_main(args) == 0
    name = OPTIMIZER_FILE if damaged == "optimizer.pt" else damaged
    latest = run_dir / "flyte" / "adapters" / "v0001"
    target = latest / name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])  # truncated, as by a full disk
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    with caplog.at_level("ERROR", logger="grpo_flyte"):
        assert cli_main([*args[:-4], "--iterations", "2", "--run-dir", str(run_dir), "--resume"]) == 1
    failure = "\n".join(r.getMessage() for r in caplog.records)
    assert f"adapter {str(latest)!r}" in failure and "cannot be loaded" in failure
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert sorted(p.name for p in (run_dir / "flyte" / "adapters").iterdir()) == ["v0000", "v0001"]


def test_train_rl_outputs_outlive_the_task_in_local_mode(tmp_path, tiny_model_dir):
    """Used from Python (no CLI), the returned report and adapter folders exist after the run."""
    from grpo_flyte.driver import train_rl

    config = RunConfig(iterations=1, prompts_per_iter=2, group_size=2, max_new_tokens=4, eval_size=0, min_informative_groups=0)
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        train_rl, config=config, base_model=Dir(path=str(tiny_model_dir))
    )
    result = run.outputs()[0]
    report = Path(result.report.path) / "report.html"
    assert report.is_file() and "complete" in report.read_text()
    assert (Path(result.adapter.dir.path) / "adapter_model.safetensors").is_file()
    assert [row.iteration for row in result.history] == [1]


# --------------------------------------------------------------------------- coming from TRL


def test_a_trl_dataset_and_reward_function_work_unchanged(tmp_path, tiny_model_dir, monkeypatch):
    """A `prompt` column of chat messages, an extra column, and a reward function written for
    TRL's GRPOTrainer (conversational completions, the column as a list): a local run trains on
    them and reports the reward; no gold answer is needed without the 'correct' reward."""
    (tmp_path / "trl_rewards.py").write_text(
        "def reward_len(completions, target_len, **kwargs):\n"
        "    # from TRL's documentation, written for conversational data\n"
        "    return [-abs(t - len(c[0]['content'])) / 10 for c, t in zip(completions, target_len)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"Say something about the number {i}."}], "target_len": 10}) + "\n"
        for i in range(12)
    ))  # fmt: skip
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), "--dataset", str(data), "--rewards", "trl_rewards:reward_len=1.0",
            *TINY, "--eval-size", "2", "--iterations", "2", "--run-dir", str(run_dir)]  # fmt: skip
    assert cli_main(args) == 0
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["mean_reward"] == pytest.approx(row["reward/trl_rewards:reward_len"]) and row["mean_reward"] <= 0
        assert row["accuracy"] == 0  # no gold answers: nothing is counted correct
    answers = [json.loads(x) for x in (run_dir / "eval" / "iter-0002.jsonl").read_text().splitlines()]
    assert all(a["question"].startswith("Say something about the number") and a["answer"] == "" for a in answers)


def test_a_hub_repo_id_runs_locally_and_the_adapter_names_it(tmp_path, tiny_model_dir):
    """`--model org/name` in a local run: fetched into the Hugging Face cache (here a cache
    prepared beforehand, used offline: no network on this machine), trained, and the shared
    adapter names the repo id, not a cache path, and carries no optimizer state."""
    import shutil

    cache = tmp_path / "hf-cache"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    args = ["--local", "--model", "tiny-org/tiny-llama", *TINY, "--eval-size", "0", "--iterations", "1", "--run-dir", str(run_dir)]
    proc = subprocess.run([sys.executable, "-m", "grpo_flyte", *args], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = run_dir / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-org/tiny-llama"
    assert not (adapter / "optimizer.pt").exists()
    assert (run_dir / "flyte" / "adapters" / "v0001" / "optimizer.pt").is_file()  # kept for --resume
    # a repo id that is not in the cache (and no network): one line naming it
    missing = subprocess.run([sys.executable, "-m", "grpo_flyte", *args[:2], "no-org/no-model", *args[3:-1], str(tmp_path / "run2")],
                             env=env, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert missing.returncode == 2 and "'no-org/no-model': could not be fetched from the Hugging Face Hub" in missing.stderr
    assert [line for line in missing.stderr.splitlines() if line.startswith("error:")] == [missing.stderr.splitlines()[-1]]


class StandInHub:
    """huggingface_hub.HfApi's create_repo and upload_folder against a local folder (no network here)."""

    root: ClassVar[Path]
    fail: ClassVar[list[str]] = []

    def create_repo(self, repo_id, private=False, exist_ok=False):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)
        return type("RepoUrl", (), {"url": f"https://huggingface.co/{repo_id}"})()

    def upload_folder(self, folder_path, repo_id, commit_message=""):
        if self.fail:
            raise ConnectionError(self.fail.pop())
        import shutil

        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)


def test_push_to_hub_uploads_the_adapter_with_a_model_card(tmp_path, tiny_model_dir, monkeypatch, caplog):
    import huggingface_hub

    hub_dir = tmp_path / "hub"
    monkeypatch.setattr(StandInHub, "root", hub_dir, raising=False)
    monkeypatch.setattr(StandInHub, "fail", ["the Hub is unreachable"] * 3)  # the first attempt and both driver retries
    monkeypatch.setattr(huggingface_hub, "HfApi", StandInHub)
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--eval-size", "2", "--iterations", "1",
            "--push-to-hub", "me/tiny-grpo", "--export-adapter", "best", "--run-dir", str(run_dir)]  # fmt: skip
    with caplog.at_level("ERROR", logger="grpo_flyte"):
        assert cli_main(args) == 1  # trained, then the upload failed: the iterations are kept
    assert "the Hub is unreachable" in caplog.text and "iterations 1-1 of 1 are kept; the traceback is in" in caplog.text
    assert caplog.records[-1].getMessage() == "run failed: the Hub is unreachable"
    assert not (hub_dir / "me" / "tiny-grpo" / "README.md").exists()
    assert cli_main([*args, "--resume"]) == 0  # the resume goes straight to the upload
    repo = hub_dir / "me" / "tiny-grpo"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in repo.iterdir()}
    assert not (repo / "optimizer.pt").exists()
    card = (repo / "README.md").read_text()
    rows = read_metrics(run_dir)
    assert f"base_model: {tiny_model_dir}" in card and "library_name: peft" in card
    assert "**Data:** `arithmetic`" in card and "**Rewards:** `correct` x 1\n" in card
    # the best adapter, chosen (the tiny model never beats its start, so iteration 0's: without the choice nothing is pushed)
    assert "the adapter of iteration 0 of 1 (the best held-out evaluation)" in card
    assert f"| after (iteration 0) | {rows[0]['eval_reward']:.3f}" in card
    assert json.loads((repo / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    # pushed only after its check: the adapter's files as uploaded answered as the run's adapter did
    assert "## Verified against its adapter (2 held-out questions, greedy)" in card
    assert "- **Agreement:** 100.0% of the answers identical (at most 20% may differ)" in card
    check = json.loads((repo / "export.json").read_text())
    assert (check["form"], check["adapter"], check["adapter_iteration"], check["questions"], check["failure"]) == (
        "adapter",
        "best",
        0,
        2,
        None,
    )


EVERY_OPTION = Path(__file__).resolve().parents[1] / "data" / "every_grpo_option.yaml"


def test_a_config_file_setting_every_grpoconfig_option_runs_to_the_end(tmp_path, tiny_model_dir):
    """tests/data/every_grpo_option.yaml sets each GRPOConfig option of issue 51 away from its
    default, under TRL's names; a short run with it reaches the end and each option shows."""
    import yaml

    from grpo_flyte.config.errors import make_config
    from grpo_flyte.config.files import load_config_file

    run_dir = tmp_path / "run"
    args = ["--local", "--config", str(EVERY_OPTION), "--model", str(tiny_model_dir), "--iterations", "2", "--run-dir", str(run_dir)]
    assert cli_main([*args, *TINY]) == 0
    given = yaml.safe_load(EVERY_OPTION.read_text())
    saved = RunConfig.model_validate_json((run_dir / "config.json").read_text()).flat()
    expected = make_config(**load_config_file(EVERY_OPTION)).flat()
    moved = {k for k in expected if expected[k] != RunConfig().flat()[k]}
    assert len(moved) >= len(given) - 4  # TRL's pairs (reward_funcs + reward_weights) and renames fold into one option each
    assert {k: saved[k] for k in moved} == {k: expected[k] for k in moved}
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    trained = [r for r in rows[1:] if r["num_updates"]]
    assert trained and all(r["num_updates"] == 2 for r in trained)  # num_iterations 2: each batch trained on twice
    assert all("entropy_coef" in r and "off_policy_masked_fraction" in r for r in rows[1:])
    answers = [json.loads(line) for line in (run_dir / "eval" / "iter-0002.jsonl").read_text().splitlines()]
    assert answers and all(len(a["completions"]) == 2 for a in answers)  # num_generations_eval 2
    logged = [json.loads(line) for line in (run_dir / "completions" / "iter-0001.jsonl").read_text().splitlines()]
    assert 1 <= len(logged) <= 3 and len({c["group"] for c in logged}) == len(logged)  # 3 at most, one per prompt
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
