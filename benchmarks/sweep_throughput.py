"""A sweep on one warm pool against the same configs run one after another: wall time, engine batches, loads.

Four configs of the embedded SmolLM2-135M-Instruct that differ in the learning rate only (`--vary
seed`: in the seed only, at the default learning rate: nothing identical to decode once), 5
iterations each (4 prompts x 4 completions, 32 new tokens, a held-out evaluation of 20 questions
before and after; `--recipe-size`: the default recipe's 8 x 8, 64 tokens, 50 questions), run on
this machine in one invocation:

- (a) sequential: one `python -m grpo_flyte.driver --local` process per config, one after another
  (what a sweep was before: each run loads its own engine and base model);
- (b) sweep: one `--local --sweep learning_rate=...` process, every config at once.

Reports the wall-time ratio (b)/(a) and the CPU-time ratio (on a shared machine the wall
times carry the other jobs' load; the CPU seconds much less), the engine batches each side decoded (rows per batch, and how
many configs' groups each batcher flush held), the engine builds and train-side base loads counted
(from the run's own log lines), and whether each config's metrics and final adapter are the same
on both sides (same seed, same batches).

    python benchmarks/sweep_throughput.py                  # 4 configs x 5 iterations, ~10 minutes on 2 quiet cores
    python benchmarks/sweep_throughput.py --recipe-size    # the same at the default recipe's size, ~4x longer
    python benchmarks/sweep_throughput.py --vary seed      # seeds 0-3 instead of learning rates
    python benchmarks/sweep_throughput.py --quick    # 2 configs x 1 tiny iteration of the tests' tiny random model (the plumbing)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

TARGET_RATIO = 0.6
FULL = {"iterations": 5, "prompts_per_iter": 4, "group_size": 4, "max_new_tokens": 32, "eval_size": 20}
RECIPE = {**FULL, "prompts_per_iter": 8, "group_size": 8, "max_new_tokens": 64, "eval_size": 50}
QUICK = {"iterations": 1, "prompts_per_iter": 2, "group_size": 2, "max_new_tokens": 8, "eval_size": 2}
LEARNING_RATES = ("1e-4", "2e-4", "3e-4", "5e-4")
VARIED = {"learning_rate": LEARNING_RATES, "seed": ("0", "1", "2", "3")}  # --vary: the option the configs differ in
ENGINE_BUILT = "building the hf generator"
BASE_LOADED = "loading the base model for training"
TIMINGS = ("_s", "per_s")


def child(batches_file: str, cli_args: list[str]) -> int:
    """One side's process: the command line, with every batcher flush and engine batch recorded."""
    from grpo_flyte.engine import batching
    from grpo_flyte.launch.cli import main

    process, decode, decode_mixed = batching._process, batching._decode, batching._decode_mixed

    async def recording_process(calls):
        with open(batches_file, "a") as f:
            f.write(json.dumps({"flush": len(calls), "adapters": len({c.adapter_path for c in calls})}) + "\n")
        return await process(calls)

    def recording_decode(key, requests, adapter_path):
        with open(batches_file, "a") as f:
            f.write(json.dumps({"engine_rows": sum(r.group_size for r in requests), "groups": len(requests)}) + "\n")
        return decode(key, requests, adapter_path)

    def recording_decode_mixed(key, requests, adapter_paths):
        with open(batches_file, "a") as f:
            rows = sum(r.group_size for r in requests)
            f.write(json.dumps({"engine_rows": rows, "groups": len(requests), "adapters": len(set(adapter_paths))}) + "\n")
        return decode_mixed(key, requests, adapter_paths)

    batching._process, batching._decode, batching._decode_mixed = recording_process, recording_decode, recording_decode_mixed
    return main(cli_args)


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(cli_args: list[str], batches: Path, log: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one side's process, its children included (reward workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import sweep_throughput as s; sys.exit(s.child(sys.argv[1], sys.argv[2:]))"
    started, cpu = time.perf_counter(), _cpu_children()
    with log.open("a") as out:
        done = subprocess.run([sys.executable, "-c", code, str(batches), *cli_args], stdout=out, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"a run failed (exit {done.returncode}); its log: {log}")
    return seconds, _cpu_children() - cpu


def _batches(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    flushes = [x for x in lines if "flush" in x]
    rows = [x["engine_rows"] for x in lines if "engine_rows" in x]
    mixed = [x["adapters"] for x in lines if "engine_rows" in x and x.get("adapters", 1) > 1]
    return {
        "engine_batches": len(rows),
        "engine_rows_mean": sum(rows) / len(rows) if rows else 0,
        "engine_rows_max": max(rows, default=0),
        "flushes": len(flushes),
        "flushes_with_several_configs": sum(1 for x in flushes if x["adapters"] > 1),
        "configs_per_flush_max": max((x["adapters"] for x in flushes), default=0),
        "engine_batches_mixing_adapters": len(mixed),
        "adapters_per_engine_batch_max": max(mixed, default=1),
    }


def _loads(log: Path) -> dict:
    text = log.read_text()
    return {"engine_builds": text.count(ENGINE_BUILT), "base_loads": text.count(BASE_LOADED)}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.endswith(TIMINGS)} for row in rows]


def _compare(alone: Path, swept: Path) -> dict:
    """Whether a config's sweep run gave its lone run's metrics and adapter, and how close it came:
    the first iteration whose row differs, the last held-out accuracy and the mean training reward
    of each."""
    a, b = _metrics(alone), _metrics(swept)
    differing = sorted({k for x, y in zip(a, b, strict=False) for k in set(x) | set(y) if x.get(k) != y.get(k)})
    same_adapter = (alone / "adapter" / "adapter_model.safetensors").read_bytes() == (
        swept / "adapter" / "adapter_model.safetensors"
    ).read_bytes()

    def last_accuracy(rows: list[dict]) -> float | None:
        return next((r["eval_accuracy"] for r in reversed(rows) if "eval_accuracy" in r), None)

    def mean_reward(rows: list[dict]) -> float:
        rewards = [r["mean_reward"] for r in rows if "mean_reward" in r]
        return sum(rewards) / max(1, len(rewards))

    return {
        "same_metrics": a == b,
        "metrics_differing": differing,
        "same_adapter": same_adapter,
        "rows": [len(a), len(b)],
        "first_differing_iteration": next((x["iteration"] for x, y in zip(a, b, strict=False) if x != y), None),
        "eval_accuracy_last": [last_accuracy(a), last_accuracy(b)],
        "mean_reward": [mean_reward(a), mean_reward(b)],
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "sweep_throughput.json")
    p.add_argument("--recipe-size", action="store_true", help="the default recipe's batch and completion length")
    p.add_argument("--vary", choices=sorted(VARIED), default="learning_rate", help="the option the 4 configs differ in")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else RECIPE if args.recipe_size else FULL
    values = VARIED[args.vary][:2] if args.quick else VARIED[args.vary]
    flag = "--" + args.vary.replace("_", "-")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-sweep-bench-"))
    model = ["--model", str(_common.quick_model())] if args.quick else []
    base = ["--local", *flags, *model, "--min-informative-groups", "0"]
    print(f"{len(values)} configs x {sizes['iterations']} iterations{' of ' + _common.QUICK_MODEL if args.quick else ''}; work in {root}")
    sequential_s = sequential_cpu_s = 0.0
    for value in values:
        run_dir = root / "sequential" / f"{args.vary}={value}"
        s, cpu = _run([*base, flag, value, "--run-dir", str(run_dir)], root / "seq.batches", root / "seq.log")
        print(f"  sequential  {args.vary}={value}: {s:7.1f} s wall, {cpu:7.1f} s CPU")
        sequential_s, sequential_cpu_s = sequential_s + s, sequential_cpu_s + cpu
    sweep_args = [*base, "--sweep", f"{args.vary}=" + ",".join(values), "--run-dir", str(root / "sweep")]
    sweep_s, sweep_cpu_s = _run(sweep_args, root / "sweep.batches", root / "sweep.log")
    print(f"  sweep       {len(values)} configs at once: {sweep_s:7.1f} s wall, {sweep_cpu_s:7.1f} s CPU")
    ratio = sweep_s / sequential_s
    cpu_ratio = sweep_cpu_s / sequential_cpu_s
    names = [f"{args.vary}={value}" for value in values]
    same = {name: _compare(root / "sequential" / name, root / "sweep" / name) for name in names}
    result = {
        "machine": _common.machine(),
        "configs": len(values),
        "sizes": sizes,
        "varied": args.vary,
        "values": list(values),
        "sequential_s": sequential_s,
        "sweep_s": sweep_s,
        "ratio": ratio,
        # CPU seconds, children included: on a shared machine the wall times carry other jobs' load
        "sequential_cpu_s": sequential_cpu_s,
        "sweep_cpu_s": sweep_cpu_s,
        "cpu_ratio": cpu_ratio,
        "target": TARGET_RATIO,
        "sequential": {**_loads(root / "seq.log"), **_batches(root / "seq.batches")},
        "sweep": {**_loads(root / "sweep.log"), **_batches(root / "sweep.batches")},
        "same_as_alone": same,
    }
    for side in ("sequential", "sweep"):
        r = result[side]
        print(
            f"{side:<10}: {r['engine_builds']} engine builds, {r['base_loads']} base loads; {r['engine_batches']} engine batches of "
            f"{r['engine_rows_mean']:.0f} rows on average (max {r['engine_rows_max']}); {r['flushes_with_several_configs']} of "
            f"{r['flushes']} batcher flushes held several configs' groups (at most {r['configs_per_flush_max']}); "
            f"{r['engine_batches_mixing_adapters']} engine batches mixed adapters (at most {r['adapters_per_engine_batch_max']})"
        )
    for name, c in same.items():
        closeness = (
            ""
            if c["same_metrics"]
            else f" (rows differ from iteration {c['first_differing_iteration']}; last held-out accuracy "
            f"{c['eval_accuracy_last'][0]} alone, {c['eval_accuracy_last'][1]} in the sweep; mean training reward "
            f"{c['mean_reward'][0]:.3f} alone, {c['mean_reward'][1]:.3f} in the sweep)"
        )
        print(f"{name}: same metrics as alone: {c['same_metrics']}{closeness}, same adapter: {c['same_adapter']}")
    print(f"sweep / sequential wall time: {ratio:.2f}x ({_common.verdict(ratio, TARGET_RATIO)}); CPU time: {cpu_ratio:.2f}x")
    _common.write_result(_common.out_file(args), result)
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
