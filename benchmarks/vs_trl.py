"""Seconds per GRPO step: grpo_flyte (Flyte local mode) vs TRL's GRPOTrainer, same model and workload.

Workload, both sides: the embedded SmolLM2-135M-Instruct, 4 arithmetic prompts (grpo_flyte's
iteration-0 prompts, in its chat format) x 6 completions, 128 new tokens, the default temperature, top-p 1,
no top-k, LoRA r=16 alpha=32 on q/k/v/o, one optimizer step per step, no KL term (beta=0), learning
rate (the default), the same arithmetic reward (the default), CPU generation with
transformers on both sides.

Equal generation work: by default every completion is exactly 128 tokens on both sides (EOS is
suppressed with min_new_tokens=128: TRL through its generation_kwargs, grpo_flyte through the same
field of its SamplingRequest). Both decode in one batch of 24 rows, so
both run 128 decode steps. `--lengths natural` lets completions stop at EOS instead (then the
sides can decode different numbers of steps; the tokens are reported).

Sides, run alternately, each step timed from its start to its optimizer step:
- grpo_flyte: `train_rl` for one iteration in local mode (init_adapter, generate, score, train_step
  tasks; --truncated keep like TRL, no top-up); the step is the run's `iteration_s`
  (generate + score + train), and the whole run's wall time is reported beside it.
- trl default: GRPOTrainer with TRL's defaults for everything but the workload (model loaded as
  saved, float32; bf16 autocast on; gradient checkpointing on).
- trl fast: the fastest TRL settings found on this CPU (see TRL_FAST_BF16 and TRL_FAST_FP32; `--explore` times the
  candidates): bfloat16 weights, no gradient checkpointing.

    python benchmarks/vs_trl.py                # 3 steps per side after a warm-up, ~10 minutes
    python benchmarks/vs_trl.py --quick        # the tests' tiny random model: 2 prompts x 2, 16 tokens, 1 step, no warm-up
    python benchmarks/vs_trl.py --explore      # time TRL's candidate settings, one step each
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from _loops import flyte_iteration
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from grpo_flyte.config.constants import ANSWER_INSTRUCTION, SYSTEM_PROMPT
from grpo_flyte.config.run import RunConfig
from grpo_flyte.data import sample_prompts, train_eval_split
from grpo_flyte.models.embedded import embedded_model_dir
from grpo_flyte.runtime.torch_thread import on_torch_thread

TARGET = 0.55

# What TRL's fastest settings change from its defaults (measured with --explore; docs/measurements.md, "Benchmarks"):
# bfloat16 weights where bfloat16 matmuls are fast (AVX-512/AMX, a GPU); on a CPU without them
# (AVX2 only: bfloat16 is 30-50x slower there) float32 weights and no bfloat16 autocast, the same
# dtype grpo_flyte's 'auto' picks there.
TRL_FAST_BF16: dict[str, Any] = {"model_dtype": "bfloat16", "gradient_checkpointing": False}
TRL_FAST_FP32: dict[str, Any] = {"gradient_checkpointing": False, "bf16": False}
# --explore: settings a user would try first, each changed from TRL's defaults (which the main
# comparison measures, as it does the fast settings).
TRL_CANDIDATES: dict[str, dict[str, Any]] = {
    "no grad ckpt (fp32 weights)": {"gradient_checkpointing": False},
    "bf16 weights (grad ckpt on)": {"model_dtype": "bfloat16"},
    "bf16 weights, no grad ckpt, no autocast": {"model_dtype": "bfloat16", "gradient_checkpointing": False, "bf16": False},
    "fp32 weights, no grad ckpt, no autocast": TRL_FAST_FP32,
}


@contextlib.contextmanager
def completions_at_full_length(enabled: bool):
    """Make grpo_flyte decode exactly max_new_tokens per completion (end of sequence held off).

    Sets `min_new_tokens` on every SamplingRequest the run builds (vLLM's min_tokens), the same
    knob TRL gets through generation_kwargs. Nothing else changes.
    """
    if not enabled:
        yield
        return
    from grpo_flyte.engine import interface

    original = interface.sampling_request

    def full_length(*args, **kwargs):
        request = original(*args, **kwargs)
        return request.model_copy(update={"min_new_tokens": request.max_new_tokens})

    interface.sampling_request = full_length
    try:
        yield
    finally:
        interface.sampling_request = original


def trl_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """grpo_flyte's arithmetic reward on TRL's (chat) completions."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [_common.arithmetic_reward(t, a) for t, a in zip(texts, answer, strict=True)]


class StepTimer(TrainerCallback):
    """Seconds from each step's start (generation included) to its end."""

    def __init__(self):
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._started)


def trl_rows(examples) -> list[dict[str, Any]]:
    """The examples in TRL's conversational format, as grpo_flyte's chat prompt renders them."""
    return [
        {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"{ex.question} {ANSWER_INSTRUCTION}"}],
            "answer": ex.answer,
        }
        for ex in examples
    ]


def trl_args(config: RunConfig, output_dir: Path, settings: dict[str, Any], **overrides: Any):
    """TRL's GRPOConfig for grpo_flyte's settings where both have them (CPU, no KL term, one
    update per batch), plus `settings` (TRL_FAST_*) and `overrides`; and the LoRA config."""
    import torch
    from peft import LoraConfig
    from trl import GRPOConfig

    settings = dict(settings)
    dtype = settings.pop("model_dtype", None)
    args = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=config.seed,
        per_device_train_batch_size=config.rollouts_per_iter,
        gradient_accumulation_steps=1,
        num_generations=config.sampling.group_size,
        max_completion_length=config.sampling.max_new_tokens,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=config.train.learning_rate,
        model_init_kwargs={"dtype": getattr(torch, dtype)} if dtype else None,
        **settings,
        **overrides,
    )
    lora = LoraConfig(
        r=config.lora.lora_rank,
        lora_alpha=config.lora.lora_alpha,
        lora_dropout=config.lora.lora_dropout,
        target_modules=list(config.lora.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return args, lora


def build_trl(config: RunConfig, model_dir: Path, work: Path, settings: dict[str, Any], fixed_length: bool):
    from datasets import Dataset
    from trl import GRPOTrainer

    dataset, _ = train_eval_split(config)
    prompts = sample_prompts(dataset, seed=config.seed, iteration=0, num=config.prompts_per_iter)
    args, lora = trl_args(
        config,
        work,
        settings,
        max_steps=1,
        generation_kwargs={"min_new_tokens": config.sampling.max_new_tokens} if fixed_length else None,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=trl_reward,
        args=args,
        train_dataset=Dataset.from_list(trl_rows(prompts)),
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # the log dict of every step; the summary says it
    return trainer, timer


def trl_step(trainer, timer: StepTimer) -> dict[str, Any]:
    """One optimizer step (train() with max_steps=1 again: a fresh optimizer each call, which the
    step timer does not see)."""
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h][-1]
    s = timer.seconds[-1]
    return {
        "s": s,
        "train_call_s": wall,
        "completion_len_mean": logs["completions/mean_length"],
        "completion_len_max": logs["completions/max_length"],
        "note": f"{logs['completions/mean_length']:.0f} mean / {logs['completions/max_length']:.0f} max tokens",
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "vs_trl.json")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side, after one warm-up step each")
    p.add_argument("--lengths", choices=["fixed", "natural"], default="fixed")
    p.add_argument("--explore", action="store_true", help="time TRL's candidate settings (one step each) instead")
    p.add_argument(
        "--no-default-side",
        action="store_true",
        help="skip TRL's defaults (bfloat16 autocast: many minutes a step on a CPU without fast bfloat16)",
    )
    args = p.parse_args(argv)
    from grpo_flyte.runtime.device import fast_bfloat16

    trl_fast_settings = TRL_FAST_BF16 if fast_bfloat16() else TRL_FAST_FP32
    _common.quiet_logs()
    try:
        import trl
    except ImportError:
        print("TRL is not installed: pip install 'grpo-flyte[bench]'")
        return 1
    sizes = (
        {"prompts_per_iter": 2, "group_size": 2, "max_new_tokens": 16}
        if args.quick
        else {"prompts_per_iter": 4, "group_size": 6, "max_new_tokens": 128}
    )
    steps = 1 if args.quick else args.steps
    fixed = args.lengths == "fixed"
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-vs-trl-"))
    model_dir = _common.quick_model() if args.quick else embedded_model_dir()
    model = {"model": str(model_dir)} if args.quick else {}  # the config as saved says which model ran
    config = RunConfig(iterations=1, eval_size=0, min_informative_groups=0, truncated="keep", beta=0.0, **sizes, **model)
    counter = iter(range(10_000))
    print(
        f"workload: {config.prompts_per_iter} prompts x {config.sampling.group_size} completions, {config.sampling.max_new_tokens} new tokens "
        f"({'exactly, EOS suppressed' if fixed else 'at most'}), LoRA r{config.lora.lora_rank} on {','.join(config.lora.lora_target_modules)}, "
        f"beta 0, one optimizer step; TRL {trl.__version__}"
    )
    try:
        if args.explore:
            return explore(config, model_dir, root, fixed, args.out or args.default_out)

        def grpo_side() -> dict[str, Any]:
            run_dir = root / f"flyte-{next(counter)}"
            started = time.perf_counter()
            with completions_at_full_length(fixed):
                row = flyte_iteration(config, model_dir, run_dir)["row"]
            wall = time.perf_counter() - started
            return {
                "s": row["iteration_s"],
                "run_s": wall,
                "generate_s": row["generate_s"],
                "train_s": row["train_s"],
                "completion_len_mean": row["completion_len_mean"],
                "completion_len_max": row["completion_len_max"],
                "num_contributing": row["num_contributing"],
                "note": (
                    f"generate {row['generate_s']:.1f} s, train {row['train_s']:.1f} s on {row['num_contributing']} rollouts; "
                    f"{row['completion_len_mean']:.0f} mean / {row['completion_len_max']} max tokens; whole run {wall:.1f} s"
                ),
            }

        # TRL runs on the thread grpo_flyte's tasks run torch on: two threads driving torch slow both.
        trl_fast, fast_timer = on_torch_thread(build_trl, config, model_dir, root / "trl-fast", trl_fast_settings, fixed)
        sides = {"grpo_flyte": grpo_side, "trl fast": lambda: on_torch_thread(trl_step, trl_fast, fast_timer)}
        if not args.no_default_side:
            trl_default, default_timer = on_torch_thread(build_trl, config, model_dir, root / "trl-default", {}, fixed)
            sides["trl default"] = lambda: on_torch_thread(trl_step, trl_default, default_timer)
        if not args.quick:  # --quick: the plumbing, which the timed step runs all of
            print("warm-up: one step per side (excluded)")
            for name, side in sides.items():
                print(f"  {name:<12} {side()['s']:.1f} s")
        print(f"{steps} timed steps per side, order rotating")
        runs = _common.alternate(sides, steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    vs_fast = _common.paired_ratios(runs["grpo_flyte"], runs["trl fast"])
    vs_default = _common.paired_ratios(runs["grpo_flyte"], runs["trl default"]) if "trl default" in runs else []
    ratio = statistics.median(vs_fast)
    ratio_default = statistics.median(vs_default) if vs_default else None
    med = {name: _common.median_s(r) for name, r in runs.items()}
    tokens = {name: statistics.median(x["completion_len_mean"] for x in r) for name, r in runs.items()}
    print(
        f"\ngrpo_flyte / TRL fastest = {ratio:.3f}x (per step {', '.join(f'{r:.3f}' for r in vs_fast)}); {_common.verdict(ratio, TARGET)}"
    )
    if ratio_default is not None:
        print(f"grpo_flyte / TRL default = {ratio_default:.3f}x")
    print(
        f"  seconds per step (median): grpo_flyte {med['grpo_flyte']:.2f} (whole local run "
        f"{_common.median_s(runs['grpo_flyte'], 'run_s'):.2f}), TRL default {med.get('trl default', float('nan')):.2f}, TRL fast {med['trl fast']:.2f}"
    )
    print(
        "  tokens per completion (median of the steps' means): "
        + ", ".join(f"{name} {t:.1f}" for name, t in tokens.items())
        + (" (fixed length: equal generation work)" if fixed else " (natural lengths: generation work may differ)")
    )
    print(
        "  fairness: same model, prompts, reward, sampling settings, LoRA and one step on both sides; grpo_flyte "
        "trains only on rollouts with a nonzero advantage (median "
        f"{statistics.median(x['num_contributing'] for x in runs['grpo_flyte']):.0f} of {config.rollouts_per_iter}), "
        "TRL forwards all of them; with beta 0 neither side runs a reference pass on this first iteration"
    )
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "vs_trl",
            "machine": _common.machine(),
            "trl": trl.__version__,
            "lengths": args.lengths,
            "config": config.flat(),
            "trl_fast_settings": trl_fast_settings,
            "runs": runs,
            "ratios_vs_fast": vs_fast,
            "ratio_vs_fast": ratio,
            "ratios_vs_default": vs_default,
            "ratio_vs_default": ratio_default,
            "median_s": med,
            "target": TARGET,
        },
    )
    return 0


def explore(config: RunConfig, model_dir: Path, root: Path, fixed: bool, out: Path) -> int:
    """One warm-up and one timed step per candidate setting, one candidate after another."""
    found = {}
    for name, settings in TRL_CANDIDATES.items():
        trainer, timer = on_torch_thread(build_trl, config, model_dir, root / f"trl-{len(found)}", settings, fixed)
        on_torch_thread(trl_step, trainer, timer)
        step = on_torch_thread(trl_step, trainer, timer)
        found[name] = step
        print(f"  {name:<42} {step['s']:6.1f} s  ({step['note']})")
        _common.flush()
        del trainer
    best = min(found, key=lambda k: found[k]["s"])
    print(f"fastest: {best}")
    _common.write_result(
        out.with_name(out.stem + "_explore.json"), {"benchmark": "vs_trl --explore", "machine": _common.machine(), "candidates": found}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
