"""QLoRA: the train pool's parameter memory and seconds per GRPO step, 16-bit base vs --load-in-4bit.

The embedded SmolLM2-135M-Instruct loads as the train pool loads it (`policy.peft_model`, the
default LoRA on q/k/v/o), once in bfloat16 and once with its linear layers in NF4 (double
quantization, bfloat16 compute). Parameter memory is every byte the model holds: parameters,
buffers and, for the 4-bit layers, their quantization state (the absmax scales, themselves
quantized, and the code books). `param_memory_ratio` is 16-bit / 4-bit (target >= 3);
`param_memory_ratio_embeddings_4bit` is the same with `--embeddings-in-4bit` (the embedding
matrix and output layer in NF4 too, beyond QLoRA's recipe: a third model, "4-bit+embeddings");
`linear_memory_ratio` is the same over the decoder's linear layers alone, the part that 4 bits
shrink (the embeddings and norms stay in 16 bits: a fifth of this small model, a few percent of a
7B one).

Then how far each 4-bit base is from the 16-bit one, which keeps generating (`base_mismatch`): on
held-out arithmetic prompts in the run's chat format followed by the reference answer, the mean
per-token KL(4-bit || 16-bit) of the next-token distributions and the mean |log-prob difference|
of the actual next tokens, at the answer's positions. This is what the trainer's
importance-sampling correction has to absorb: on a 7B model NF4 is known to move the
distribution little; on this 135M model, itself converted from a 4-bit GGUF, it is large.

Then the same GRPO step (`policy_update.grpo_step`, default config, one optimizer step) on one fixed
batch of token ids, the two models alternately, median seconds per step. On a CPU the 4-bit
layers dequantize their weights in every forward and backward, so the step is slower there.

    python benchmarks/qlora_memory.py            # 8 sequences, 3 rounds, ~5 minutes on a 2-core CPU
    python benchmarks/qlora_memory.py --quick    # the tests' tiny random model: 2 sequences, 1 round, no warm-up
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import _common

from grpo_flyte.config.run import RunConfig
from grpo_flyte.learning import grpo, policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.models.embedded import embedded_model_dir
from grpo_flyte.runtime.device import resolve_dtype

TARGET = 3.0
EMBEDDINGS = "4-bit+embeddings"  # --load-in-4bit --embeddings-in-4bit


def model_bytes(model) -> dict[str, int]:
    """Bytes the model holds: all of it, and its decoder's linear layers (base weights only). A 4-bit
    weight adds its quantization state, once (a tied output layer shares the embedding's)."""
    import torch

    def quant_state_bytes(weight) -> int:
        state = getattr(weight, "quant_state", None)
        if state is None:
            return 0
        return sum(v.numel() * v.element_size() for v in state.as_dict(packed=True).values() if isinstance(v, torch.Tensor))

    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    total += sum(quant_state_bytes(w) for w in {id(w): w for w in model.parameters()}.values())
    linear = 0
    for name, module in model.named_modules():
        # the decoder's own linear layers (a 4-bit one is an nn.Linear too), not LoRA's nor the output layer
        if isinstance(module, torch.nn.Linear) and ".layers." in name and "lora_" not in name:
            linear += module.weight.numel() * module.weight.element_size() + quant_state_bytes(module.weight)
    return {"total": total, "linear": linear}


def base_mismatch(models: dict, config: RunConfig, model_path: str, num: int) -> dict[str, dict]:
    """How far each 4-bit side's next-token distributions are from the 16-bit side's, on `num`
    held-out questions followed by their reference answers (the answer's positions, temperature 1,
    fresh adapters: the bases alone): mean KL(4-bit || 16-bit) per token and mean |delta log p| of
    the answer's tokens."""
    import torch
    from transformers import AutoTokenizer

    from grpo_flyte.data import train_eval_split
    from grpo_flyte.engine.prompts import tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    _, held_out = train_eval_split(config.model_copy(update={"evaluation": config.evaluation.model_copy(update={"eval_size": num})}))
    sequences = [
        grpo.TrainSequence(
            tokenize_prompt(tokenizer, ex, config.prompt), tokenizer.encode(f"#### {ex.answer}", add_special_tokens=False), 0.0
        )
        for ex in held_out
    ]
    padded = grpo.pad_batch(sequences, pad_id=0)
    targets = padded.targets[padded.predict_mask]
    with torch.no_grad():
        logp = {side: torch.log_softmax(policy_update._completion_logits(model, padded).float(), dim=-1) for side, model in models.items()}
    sixteen = logp["16-bit"]
    result: dict[str, dict] = {"sample": {"questions": len(sequences), "tokens": int(targets.numel())}}
    for side in [s for s in models if s != "16-bit"]:
        kl = (logp[side].exp() * (logp[side] - sixteen)).sum(-1)
        chosen = (logp[side] - sixteen).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        result[side] = {"kl_per_token": float(kl.mean()), "abs_logp_diff": float(chosen.abs().mean())}
    return result


def batch(num: int, vocab: int, seed: int = 0) -> list[grpo.TrainSequence]:
    """`num` rollouts: 48-token prompts, 16 to 64-token completions, advantages +-1."""
    rng = random.Random(seed)
    return [
        grpo.TrainSequence(
            [rng.randrange(vocab) for _ in range(48)],
            [rng.randrange(vocab) for _ in range(rng.randint(16, 64))],
            1.0 if i % 2 == 0 else -1.0,
            None,
        )
        for i in range(num)
    ]


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "qlora_memory.json")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    _common.quiet_logs()

    rounds = 1 if args.quick else args.rounds
    num = 2 if args.quick else 8
    model_path = str(_common.quick_model() if args.quick else embedded_model_dir())
    models, memory, configs = {}, {}, {}
    sides = {"16-bit": {}, "4-bit": {"load_in_4bit": True}, EMBEDDINGS: {"load_in_4bit": True, "embeddings_in_4bit": True}}
    for side, settings in sides.items():
        config = RunConfig(dtype="bfloat16", eval_size=0, **settings)
        policy._peft_model.cache_clear()  # one model per side, all kept
        model = policy.peft_model(config.base, config.lora, model_path)
        policy.reset_lora(model, config.seed)
        models[side], configs[side], memory[side] = model, config, model_bytes(model)
        print(f"{side}: {memory[side]['total'] / 2**20:.1f} MiB in all, {memory[side]['linear'] / 2**20:.1f} MiB of decoder linear layers")
    ratio = memory["16-bit"]["total"] / memory["4-bit"]["total"]
    ratio_embeddings = memory["16-bit"]["total"] / memory[EMBEDDINGS]["total"]
    linear_ratio = memory["16-bit"]["linear"] / memory["4-bit"]["linear"]
    mismatch = base_mismatch(models, configs["4-bit"], model_path, 4 if args.quick else 50)
    for side in [s for s in models if s != "16-bit"]:
        print(
            f"{side} base against the 16-bit one on {mismatch['sample']['tokens']} reference-answer tokens of "
            f"{mismatch['sample']['questions']} held-out questions: KL {mismatch[side]['kl_per_token']:.3f} nats a token, "
            f"|delta log p| {mismatch[side]['abs_logp_diff']:.3f}"
        )

    sequences = batch(num, models["16-bit"].get_base_model().config.vocab_size)
    optimizers = {side: policy._optimizer(models[side], configs[side].train) for side in models}

    def step(side: str):
        def run() -> dict:
            started = time.perf_counter()
            stats = policy_update.grpo_step(models[side], optimizers[side], sequences, configs[side].train, configs[side].sampling)
            return {"s": time.perf_counter() - started, "loss": stats.loss}

        return run

    if not args.quick:
        print("warm-up: one step of each side (excluded)")
        for side in models:
            step(side)()
    print(f"{rounds} rounds of {num} sequences, order rotating")
    runs = _common.alternate({side: step(side) for side in models}, rounds)
    seconds = {side: _common.median_s(runs[side]) for side in runs}
    slowdowns = _common.paired_ratios(runs["4-bit"], runs["16-bit"])
    slowdowns_embeddings = _common.paired_ratios(runs[EMBEDDINGS], runs["16-bit"])

    print(
        f"\nparameter memory 16-bit / 4-bit = {ratio:.2f}x ({_common.verdict(ratio, TARGET, higher_is_better=True)}); "
        f"decoder linear layers alone {linear_ratio:.2f}x; with --embeddings-in-4bit {ratio_embeddings:.2f}x "
        f"({_common.verdict(ratio_embeddings, TARGET, higher_is_better=True)})"
    )
    print(
        f"seconds per step: 16-bit {seconds['16-bit']:.2f} s, 4-bit {seconds['4-bit']:.2f} s "
        f"({statistics.median(slowdowns):.2f}x the 16-bit time, {resolve_dtype('bfloat16')} compute), "
        f"{EMBEDDINGS} {seconds[EMBEDDINGS]:.2f} s ({statistics.median(slowdowns_embeddings):.2f}x)"
    )
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "qlora_memory",
            "machine": _common.machine(),
            "model": _common.QUICK_MODEL if args.quick else "SmolLM2-135M-Instruct (embedded)",
            "num_sequences": num,
            "memory_bytes": memory,
            "param_memory_ratio": ratio,
            "linear_memory_ratio": linear_ratio,
            "target": TARGET,
            "param_memory_ratio_embeddings_4bit": ratio_embeddings,
            "base_mismatch": mismatch,
            "seconds_per_step": seconds,
            "step_time_ratio_4bit_over_16bit": statistics.median(slowdowns),
            "step_time_ratio_4bit_embeddings_over_16bit": statistics.median(slowdowns_embeddings),
            "runs": runs,
        },
    )
    return 0 if max(ratio, ratio_embeddings) >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
