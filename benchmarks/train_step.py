"""Trainer throughput: grpo_flyte's GRPO step vs a bare forward/backward of the same tokens.

One realistic batch first: the embedded SmolLM2-135M-Instruct (bfloat16) samples 8 prompts x 8
completions (up to 64 new tokens, the default temperature) with grpo_flyte's generator, as iteration 0 of
a default run does. Every rollout becomes a training sequence; the advantage of a rollout in a
group that scored all alike is set to +-1 (the step costs the same whatever the advantages are,
and a realistic step trains on every informative rollout). Then, alternately:

- grpo_step: `policy_update.grpo_step` with the default config (length-grouped micro-batches of up to
  4096 padded tokens, the vocabulary projection only at completion positions, the KL-monitor
  reference pass on 8 sequences, importance weights, clipped loss, grad clip, AdamW step);
- train path: the `train_step` task body around it (load adapter + AdamW state, grpo_step, save);
- bare: the same PEFT model on one right-padded batch of all sequences, logits -> float
  log_softmax -> gather the next tokens -> mean over completion tokens -> backward -> AdamW step.

Tokens per second count the real (unpadded) prompt + completion tokens, the same for every side,
so the ratio is bare seconds / grpo seconds. Prints the median of the per-round ratios.

    python benchmarks/train_step.py            # 5 rounds, ~4 minutes on a 2-core CPU
    python benchmarks/train_step.py --quick    # the tests' tiny random model: 2 x 4 rollouts, 1 round, no warm-up
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common

from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import train_eval_split
from grpo_flyte.engine.cache import EngineKey, get_engine
from grpo_flyte.learning import grpo, policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.models.embedded import embedded_model_dir
from grpo_flyte.runtime.device import resolve_dtype

TARGET = 0.9


def realistic_sequences(config: RunConfig, model_path: str, adapter_dir: Path) -> list[grpo.TrainSequence]:
    """Iteration 0's rollouts of a default run, all of them, as training sequences."""
    engine = get_engine(EngineKey("hf", model_path, resolve_dtype(config.base.dtype), config.engine.adapter_cache_size, 0, 0))
    dataset, _ = train_eval_split(config)
    return _common.every_rollout_sequences(engine, config, dataset, adapter_dir, 0)


def bare_step(model, optimizer, sequences: list[grpo.TrainSequence]) -> float:
    """One padded batch through the plain PEFT model: mean completion-token log-prob, backward, step."""
    import torch

    batch = grpo.pad_batch(sequences, pad_id=0)  # right-padded (B, T); targets are the next tokens
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    loss = -(logp * batch.predict_mask).sum() / batch.predict_mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "train_step.json")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    _common.quiet_logs()
    import torch

    sizes = {"prompts_per_iter": 2, "group_size": 4, "max_new_tokens": 32} if args.quick else {}
    rounds = 1 if args.quick else args.rounds
    model_path = str(_common.quick_model() if args.quick else embedded_model_dir())
    config = RunConfig(eval_size=0, **sizes, **({"model": model_path} if args.quick else {}))  # as saved: which model ran
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-train-"))
    try:
        model = policy.peft_model(config.base, config.lora, model_path)
        policy.reset_lora(model, config.seed)
        v0 = root / "v0000"
        policy.save_adapter(model, None, 0, v0)
        with _common.Stopwatch() as gen:
            sequences = realistic_sequences(config, model_path, v0)
        tokens = sum(s.length for s in sequences)
        completion_tokens = sum(len(s.completion_ids) for s in sequences)
        width = max(s.length for s in sequences)
        print(
            f"batch: {len(sequences)} rollouts of {model_path.rsplit('/', 1)[-1]} ({resolve_dtype(config.base.dtype)}), "
            f"{tokens} tokens ({completion_tokens} completion), {len(sequences) * width} when padded to one batch; "
            f"generated in {gen.s:.1f} s"
        )
        grpo_optimizer = policy.load_adapter_state(model, str(v0), config.train)
        bare_optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.train.learning_rate)
        counter = iter(range(10_000))

        def grpo_side() -> dict:
            started = time.perf_counter()
            stats = policy_update.grpo_step(model, grpo_optimizer, sequences, config.train, config.sampling)
            s = time.perf_counter() - started
            return {"s": s, "tokens_per_s": tokens / s, "loss": stats.loss, "note": f"{tokens / s:.0f} tokens/s"}

        def train_path_side() -> dict:
            # The train_step task's body: adapter + optimizer state in, grpo_step, new adapter out.
            started = time.perf_counter()
            optimizer = policy.load_adapter_state(model, str(v0), config.train)
            policy_update.grpo_step(model, optimizer, sequences, config.train, config.sampling)
            policy.save_adapter(model, optimizer, 1, root / f"v{next(counter) + 1:04d}")
            s = time.perf_counter() - started
            return {"s": s, "tokens_per_s": tokens / s, "note": f"{tokens / s:.0f} tokens/s"}

        def bare_side() -> dict:
            started = time.perf_counter()
            loss = bare_step(model, bare_optimizer, sequences)
            s = time.perf_counter() - started
            return {"s": s, "tokens_per_s": tokens / s, "loss": loss, "note": f"{tokens / s:.0f} tokens/s"}

        if not args.quick:  # --quick: the plumbing, which the timed round runs all of
            print("warm-up: one step of each side (excluded)")
            grpo_side(), bare_side()
        print(f"{rounds} rounds, order rotating")
        runs = _common.alternate({"grpo_step": grpo_side, "bare": bare_side, "train path": train_path_side}, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratios = _common.paired_ratios(runs["bare"], runs["grpo_step"])  # throughput ratio = inverse time ratio
    path_ratios = _common.paired_ratios(runs["bare"], runs["train path"])
    ratio, path_ratio = statistics.median(ratios), statistics.median(path_ratios)
    grpo_s, bare_s, path_s = (_common.median_s(runs[k]) for k in ("grpo_step", "bare", "train path"))
    print(
        f"\ngrpo_step / bare throughput = {ratio:.3f}x (per round {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"{_common.verdict(ratio, TARGET, higher_is_better=True)}"
    )
    print(f"  grpo_step {grpo_s:.2f} s = {tokens / grpo_s:.0f} tokens/s; bare {bare_s:.2f} s = {tokens / bare_s:.0f} tokens/s")
    print(f"  train path (load state + grpo_step + save) {path_s:.2f} s = {tokens / path_s:.0f} tokens/s, {path_ratio:.3f}x of bare")
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "train_step",
            "machine": _common.machine(),
            "config": config.flat(),
            "num_sequences": len(sequences),
            "tokens": tokens,
            "completion_tokens": completion_tokens,
            "padded_tokens_one_batch": len(sequences) * width,
            "runs": runs,
            "ratios": ratios,
            "ratio": ratio,
            "train_path_ratios": path_ratios,
            "train_path_ratio": path_ratio,
            "grpo_step_s": grpo_s,
            "bare_s": bare_s,
            "train_path_s": path_s,
            "target": TARGET,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
