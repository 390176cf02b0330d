"""The train step's peak GPU memory and time at the default recipe, for models of the shapes of
Qwen3-0.6B, 1.7B and 4B, in bfloat16 and with --load-in-4bit, against an NVIDIA L4's 24 GB.

Each model is random (a Qwen3Config with the public model's numbers; memory and speed do not depend
on the weights' values), saved once and loaded the way the train pool loads it
(`policy.peft_model`: `models.loading.load_base`, 16 bits or NF4 through the QLoRA path, the
default LoRA), with its AdamW state as `train_step` restores it (`policy.load_adapter_state`).
The batch is the default recipe's: `prompts_per_iter` x `group_size` rollouts (RunConfig's
defaults), each a prompt of --prompt-tokens random ids and a completion of `max_new_tokens` (the
longest a rollout gets: the step's peak), advantages +-1 so that every rollout is trained, in
`micro_batch_tokens` micro-batches, gradient checkpointing as RunConfig sets it. One warm-up step
(an iteration with the KL monitor's reference pass, so its memory is in the peak) and --steps
timed ones (`policy_update.grpo_step`, what `train_step` runs).

Per model and mode, in a process of its own (the peaks of one never reach the next): torch's peak
reserved and allocated GPU memory over loading and the steps, the CUDA context and libraries
beside it (the device's used memory minus torch's reserved, after the steps), their sum (what the
process needs of the GPU), seconds per timed step, tokens (prompt + completion) per second, and
whether that sum fits an L4 (23034 MiB, what an L4 reports of its 24 GB) with the headroom left.
On a CPU (--quick) the figure is the resident memory of the process (`grpo_flyte.runtime.memory`).

It imports neither Flyte nor anything that needs it: on a machine without the `flyte` package a
stand-in for `flyte.io.Dir` (the one name grpo_flyte's value types take from it) is installed
first. It needs torch, transformers, peft, pydantic, pydantic-settings and, for the 4-bit rows,
bitsandbytes; without bitsandbytes' kernels the 4-bit rows are skipped with a note saying why.

    python benchmarks/gpu_sizing.py                      # a GPU: 3 shapes x 2 modes, a process each (estimated 2-3 min on an H200)
    python benchmarks/gpu_sizing.py --sizes Qwen3-4B     # one shape
    python benchmarks/gpu_sizing.py --quick --out x.json # this CPU: a tiny Qwen3 shape, in this process (< 1 min)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import _common

# The public config.json of each model (hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads); every one has head_dim 128, a 151,936-token vocabulary
# and its output layer tied to the embeddings.
SHAPES: dict[str, dict[str, int]] = {
    "Qwen3-0.6B": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8},
    "Qwen3-1.7B": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8},
    "Qwen3-4B": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8},
}  # fmt: skip
COMMON = {"head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
# --quick: the same architecture, tiny (the vocabulary kept: its logits are a large part of the step)
TINY = {
    "tiny-Qwen3": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
}
TINY_COMMON = {**COMMON, "head_dim": 16}
MODES = {"16-bit": False, "4-bit": True}  # mode -> load_in_4bit (--load-in-4bit: NF4 linear layers computing in 16 bits)
# What an NVIDIA L4 reports (nvidia-smi, torch's total_memory): 23034 MiB of its nominal 24 GB.
L4_GIB = 23034 / 1024
GIB = 2**30
PROMPT_TOKENS = 128  # a GSM8K question in a chat template is about 100-200 tokens
JOB_TIMEOUT_S = 150  # one model and mode; the whole run is meant to take under 4 minutes on an H200


def num_params(shape: dict[str, int], common: dict[str, Any]) -> int:
    """The base model's parameters: the (tied) embedding matrix, per layer the attention's q, k, v,
    o projections, q and k norms, the MLP's gate, up and down projections and two norms, and the
    final norm."""
    h, i, d, v = shape["hidden_size"], shape["intermediate_size"], common["head_dim"], common["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    layer = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d + 3 * h * i + 2 * h
    return v * h + shape["num_hidden_layers"] * layer + h


def without_flyte() -> None:
    """Where the `flyte` package is missing, a stand-in for the one name grpo_flyte's value types
    import from it (`flyte.io.Dir`, a field type of AdapterRef): this benchmark never makes one."""
    if importlib.util.find_spec("flyte") is not None:
        return
    from pydantic import BaseModel

    class Dir(BaseModel):
        path: str
        name: str | None = None

    flyte, io = types.ModuleType("flyte"), types.ModuleType("flyte.io")
    io.Dir, flyte.io = Dir, io
    sys.modules.update({"flyte": flyte, "flyte.io": io})


def recipe(quick: bool, load_in_4bit: bool, changes: dict[str, str] | None = None):
    """The default RunConfig in bfloat16 (--quick: 2 prompts x 4 completions of 16 tokens, in the
    dtype 'auto' picks: float32 on a CPU without fast bfloat16, where bfloat16 is emulated), with
    `changes` (--set: RunConfig fields, values as on the command line) in place of its values."""
    from grpo_flyte.config.run import RunConfig

    sizes = {"prompts_per_iter": 2, "group_size": 4, "max_new_tokens": 16, "dtype": "auto"} if quick else {"dtype": "bfloat16"}
    return RunConfig(**{"load_in_4bit": load_in_4bit, "eval_size": 0, **sizes, **(changes or {})})


def recipe_summary(quick: bool, prompt_tokens: int, changes: dict[str, str] | None = None) -> dict[str, Any]:
    config = recipe(quick, False, changes)
    return {
        "rollouts": config.prompts_per_iter * config.sampling.group_size,
        "prompts_per_iter": config.prompts_per_iter,
        "group_size": config.sampling.group_size,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": config.sampling.max_new_tokens,
        "lora_rank": config.lora.lora_rank,
        "lora_target_modules": list(config.lora.lora_target_modules),
        "micro_batch_tokens": config.train.token_budget("cuda"),
        "gradient_checkpointing": config.train.gradient_checkpointing,
        "updates_per_iter": config.train.updates_per_iter,
        "kl_monitor_every": config.train.kl_monitor_every,
        "dtype": config.base.dtype,
    }


def build(shape: dict[str, int], common: dict[str, Any], folder: Path, device: str) -> None:
    """A random Qwen3 of `shape` in bfloat16, built on `device` and saved to `folder` (a float32
    run loads it in float32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in 16 bits: no float32 copy first
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**common, **shape, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def nf4_unavailable(device: str) -> str | None:
    """Why the 4-bit rows cannot run on `device` (None: they can): bitsandbytes missing, or its
    kernels failing on a small matrix."""
    try:
        import bitsandbytes as bnb
        import torch
    except ImportError as exc:
        return f"bitsandbytes is not installed ({exc})"
    try:
        packed, state = bnb.functional.quantize_4bit(torch.randn(64, 64, device=device, dtype=torch.bfloat16), quant_type="nf4")
        bnb.functional.dequantize_4bit(packed, state)
    except Exception as exc:  # noqa: BLE001 -- a missing kernel raises in many ways
        return f"bitsandbytes' {device} kernels do not run here ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def batch(config, prompt_tokens: int, vocab: int, seed: int = 0) -> list:
    """The recipe's rollouts as training sequences: random prompt and completion ids, every
    completion at max_new_tokens, advantages +-1 within each group, sampling log-probs of a uniform
    distribution (a random model's)."""
    import random

    from grpo_flyte.learning import grpo

    rng = random.Random(seed)
    n, group = config.sampling.max_new_tokens, config.sampling.group_size
    sequences = []
    for _ in range(config.prompts_per_iter):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for k in range(group):
            completion = [rng.randrange(vocab) for _ in range(n)]
            sequences.append(grpo.TrainSequence(prompt, completion, 1.0 if k % 2 == 0 else -1.0, [-math.log(vocab)] * n))
    return sequences


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """One model and mode: load, one warm-up step, `steps` timed steps; the figures (see the module's docstring)."""
    without_flyte()
    _common.quiet_logs()
    import torch

    from grpo_flyte.learning import policy
    from grpo_flyte.learning import update as policy_update
    from grpo_flyte.runtime import memory
    from grpo_flyte.runtime.device import best_device, resolve_dtype

    device = best_device()
    on_gpu = device == "cuda"
    if not on_gpu and not job["quick"]:
        raise SystemExit("no CUDA GPU here: the full run measures a GPU (--quick runs the tiny shape on a CPU)")
    shape, common, folder = job["shape"], job["common"], Path(job["folder"])
    load_in_4bit = MODES[job["mode"]]
    config = recipe(job["quick"], load_in_4bit, job.get("changes"))
    row: dict[str, Any] = {
        "model": job["name"], "mode": job["mode"], "params": num_params(shape, common), "device": device,
        "dtype": resolve_dtype(config.base.dtype),
    }  # fmt: skip
    if load_in_4bit:
        why = nf4_unavailable(device)
        if why is not None:
            return {**row, "skipped": why}
    if not (folder / "config.json").is_file():
        build(shape, common, folder, device)
    sequences = batch(config, job["prompt_tokens"], common["vocab_size"])
    tokens = sum(s.length for s in sequences)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with memory.span() as process, tempfile.TemporaryDirectory(prefix="gpu_sizing-adapter-") as scratch:
        model = policy.peft_model(config.base, config.lora, str(folder))
        policy.reset_lora(model, config.seed)
        if load_in_4bit is False:
            row["counted_params"] = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
        row["weights_gib"] = torch.cuda.memory_allocated() / GIB if on_gpu else None
        policy.save_adapter(model, None, 0, Path(scratch) / "v0000")
        optimizer = policy.load_adapter_state(model, str(Path(scratch) / "v0000"), config.train)
        per_iteration = config.train.steps_per_iteration
        every = max(1, config.train.kl_monitor_every)
        seconds = []
        # the warm-up is an iteration of the KL monitor (its reference pass in the peak); then iterations 1, 2, ...
        for first in [(every - 1) * per_iteration, *(k * per_iteration for k in range(job["steps"]))]:
            sync()
            started = time.perf_counter()
            policy_update.grpo_step(model, optimizer, sequences, config.train, config.sampling, (first, 0))
            sync()
            seconds.append(time.perf_counter() - started)
    step_s = sum(seconds[1:]) / len(seconds[1:])
    row.update(
        tokens_per_step=tokens, warm_up_s=seconds[0], s_per_step=step_s, tokens_per_s=tokens / step_s, peak_rss_gb=process.peak.rss_gb
    )
    if on_gpu:
        free, total = torch.cuda.mem_get_info()
        beside = (total - free - torch.cuda.memory_reserved()) / GIB  # the CUDA context, cuBLAS' workspaces, ...
        needed = torch.cuda.max_memory_reserved() / GIB + beside
        row.update(
            gpu=torch.cuda.get_device_name(),
            peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
            cuda_overhead_gib=beside,
            process_gib=needed,
            fits_l4=needed <= L4_GIB,
            l4_headroom_gib=L4_GIB - needed,
        )
    return row


def in_a_process(job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """`measure(job)` in a fresh Python process (its output on stderr as it goes); a failure is a row with its error."""
    command = [sys.executable, str(Path(__file__).resolve()), "--job", json.dumps(job)]
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"model": job["name"], "mode": job["mode"], "error": f"no result within {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = done.stdout.strip().splitlines()[-3:]
        return {"model": job["name"], "mode": job["mode"], "error": f"exit {done.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'model':<12} {'mode':<9} {'params':>7} {'weights':>8} {'reserved':>9} {'alloc':>7} {'+CUDA':>6} {'needs':>7} {'s/step':>7} {'tokens/s':>9}  L4 ({L4_GIB:.1f} GiB)"
    lines = [head, "-" * len(head)]
    for r in rows:
        start = f"{r['model']:<12} {r['mode']:<9} {r.get('params', 0) / 1e9:>6.2f}B"
        if "skipped" in r or "error" in r:
            lines.append(f"{start}  {'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('error')}")
            continue
        fits = "-" if r.get("fits_l4") is None else f"{'fits' if r['fits_l4'] else 'NO'}, {r['l4_headroom_gib']:+.1f} GiB"
        needs = _gib(r.get("process_gib")) if r.get("process_gib") is not None else f"{r['peak_rss_gb']:.2f}GB"
        lines.append(
            f"{start} {_gib(r.get('weights_gib')):>8} {_gib(r.get('peak_reserved_gib')):>9} {_gib(r.get('peak_allocated_gib')):>7} "
            f"{_gib(r.get('cuda_overhead_gib')):>6} {needs:>7} {r['s_per_step']:>7.2f} {r['tokens_per_s']:>9.0f}  {fits}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "gpu_sizing.json")
    p.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="the model shapes (default: all three)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each rollout's prompt length")
    p.add_argument(
        "--set", nargs="+", default=[], metavar="FIELD=VALUE",
        help="RunConfig fields changed from the default recipe, e.g. gradient_checkpointing=true micro_batch_tokens=2048",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--in-process", action="store_true", help="every job in this process, memory freed between (the default with --quick)")
    p.add_argument("--processes", action="store_true", help="with --quick: a fresh process per job, as the full run")
    p.add_argument("--job-timeout-s", type=float, default=JOB_TIMEOUT_S)
    p.add_argument("--job", help=argparse.SUPPRESS)  # one job's JSON: run it here, print its row
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: expected at least 1 timed step")
    if args.job:
        print("RESULT " + json.dumps(measure(json.loads(args.job))), flush=True)
        return 0
    without_flyte()  # recipe_summary reads RunConfig
    changes = dict(item.split("=", 1) for item in args.set if "=" in item)
    if len(changes) != len(args.set):
        p.error(f"--set {args.set}: expected FIELD=VALUE items")
    shapes, common = (TINY, TINY_COMMON) if args.quick else ({name: SHAPES[name] for name in args.sizes}, COMMON)
    in_process = args.in_process or (args.quick and not args.processes)
    root = Path(tempfile.mkdtemp(prefix="gpu_sizing-"))
    rows = []
    started = time.perf_counter()
    try:
        for name, shape in shapes.items():
            for mode in args.modes:
                job = {
                    "name": name, "shape": shape, "common": common, "mode": mode, "folder": str(root / name),
                    "quick": args.quick, "prompt_tokens": 16 if args.quick else args.prompt_tokens, "steps": args.steps,
                    "changes": changes,
                }  # fmt: skip
                print(f"{name} {mode} ...", flush=True)
                rows.append(_in_this_process(job) if in_process else in_a_process(job, args.job_timeout_s))
            shutil.rmtree(root / name, ignore_errors=True)  # its weights: gigabytes
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows))
    notes = [f"{r['model']} {r['mode']}: skipped, {r['skipped']}" for r in rows if "skipped" in r]
    for note in notes:
        print(note)
    total_s = time.perf_counter() - started
    print(f"total {total_s:.0f} s")
    result = {
        "benchmark": "gpu_sizing",
        "recipe": recipe_summary(args.quick, 16 if args.quick else args.prompt_tokens, changes),
        "l4_gib": L4_GIB,
        "timed_steps": args.steps,
        "in_process": in_process,
        "rows": rows,
        "notes": notes,
        "total_s": total_s,
        "shapes": {name: {**common, **shape} for name, shape in shapes.items()},
    }
    _common.write_result(_common.out_file(args), result)
    return 1 if any("error" in r for r in rows) else 0


def _in_this_process(job: dict[str, Any]) -> dict[str, Any]:
    """`measure(job)` here, then the model it loaded dropped (policy's cache) and torch's memory freed."""
    try:
        return measure(job)
    except Exception as exc:  # noqa: BLE001 -- a row with its error; the other jobs go on
        return {"model": job["name"], "mode": job["mode"], "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if "grpo_flyte.learning.policy" in sys.modules:
            sys.modules["grpo_flyte.learning.policy"].release_models()


if __name__ == "__main__":
    sys.exit(main())
