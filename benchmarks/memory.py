"""Where a local run's resident memory goes, and the peak of `make demo`, before and after issue 55's reductions.

Two measurements, each side by side for the code before (a checkout of --before, default 6d218cd,
unpacked with `git archive` into a temporary folder) and this checkout:

- **breakdown** (in one process a side, on the torch thread as a run does, the process's RSS polled
  every 50 ms and glibc's heap read with mallinfo2 after each stage): the Python and library
  baseline (torch, transformers, peft, flyte imported), the generator's copy of the base weights
  (the transformers engine, a first decode touching them), the trainer's (the PEFT model and a
  forward pass), one default iteration's rollouts (8 prompts x 8 completions of up to 64 tokens
  from the engine), and two GRPO train steps on them (the default config: activations, logits,
  gradients and AdamW state); after each, the heap glibc keeps free. "before" in this process is
  the old configuration of the same code: `--micro-batch-tokens 4096` and the trainer's own copy of
  the weights (`GRPO_FLYTE_SHARE_WEIGHTS=0`).
- **runs** (a subprocess a side: `python -m grpo_flyte.driver --local --iterations 2` at the demo's
  settings, --eval-size as given, plus each run's own flags, `RUNS`): the peak RSS of its whole
  process tree (the reward workers included), polled every 0.5 s from outside, and the seconds per
  iteration from its metrics.jsonl. The issue's targets: `demo` (2.5 GB), `sweep4` (a 4-config
  sweep, 3.5 GB), `gate` (the learning gate's 5 seeds as one sweep, 4.0 GB), `4bit` (below the
  16-bit demo), `multiturn` (an environment answering 8,000 characters of prose three times an
  episode, 2 prompts x 2 completions, every episode trained on: tests/support/chatty_env.py's
  Prose; 3.0 GB).

    OMP_NUM_THREADS=1 python benchmarks/memory.py            # breakdown and the demo (~40 min on 2 loaded cores)
    OMP_NUM_THREADS=1 python benchmarks/memory.py --part multiturn sweep4 --merge benchmarks/memory.json
    python benchmarks/memory.py --quick                      # seconds: the plumbing only (CI)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common

REPO = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "6d218cd"
GB = 1e9
SUPPORT = REPO / "tests" / "support"  # the multi-turn run's environment (the user's code: the same on both sides)
# Each run's flags beyond the demo's settings, and the target for its tree's peak (GB; None: below the demo's).
RUNS: dict[str, tuple[list[str], float | None]] = {
    "demo": ([], 2.5),
    "sweep4": (["--sweep", "seed=0,1,2,3"], 3.5),
    "gate": (["--sweep", "seed=0,1,2,3,4"], 4.0),
    "4bit": (["--load-in-4bit"], None),
    "multiturn": (["--env", "chatty_env:Prose", "--max-turns", "4", "--max-new-tokens", "8", "--max-episode-tokens", "7600",
                   "--prompts-per-iter", "2", "--group-size", "2", "--min-informative-groups", "0", "--eval-size", "0",
                   "--beta", "0.04"], 3.0),  # beta > 0: every episode trained on, even in a group of equal rewards
}  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap() -> dict[str, float]:
    """glibc's heap now (GB): in use (arena blocks and mmapped ones) and free but kept mapped; {} off glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_in_use_gb": (info.uordblks + info.hblkhd) / GB, "heap_free_kept_gb": info.fordblks / GB}


class TreePeak:
    """The peak RSS of a process tree (`grpo_flyte.runtime.memory.tree_rss`), polled on a thread."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.05):
        self.pid, self.interval_s, self.peak, self._stop = pid, interval_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        from grpo_flyte.runtime.memory import tree_rss

        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval_s)

    def restart(self) -> int:
        """The peak since the last restart; the next stage starts from the RSS now."""
        from grpo_flyte.runtime.memory import tree_rss

        now = tree_rss(self.pid)
        peak, self.peak = max(self.peak, now), now
        return peak

    def __enter__(self) -> TreePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def before_checkout(commit: str, into: Path) -> Path:
    """The package's sources at `commit`, unpacked under `into`: the folder to put on PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def demo_run(src: Path, run_dir: Path, iterations: int, eval_size: int, flags: list[str]) -> dict:
    """One local run of the driver from `src` at the demo's settings and `flags` (a later flag wins):
    its process tree's peak RSS (polled every 0.5 s), its wall time, and the seconds of each
    iteration (metrics.jsonl; a sweep's: its first config's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(SUPPORT)]), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "grpo_flyte.driver", "--local", "--iterations", str(iterations)]
    command += ["--eval-size", str(eval_size), "--run-dir", str(run_dir), *flags]
    started = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        with TreePeak(process.pid, interval_s=0.5) as tree:
            code = process.wait()
    wall = time.perf_counter() - started
    if code != 0:  # the run's own words on why (its folder goes with the temporary one)
        print((run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:], file=sys.stderr, flush=True)
    metrics = sorted(run_dir.glob("**/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics[0].read_text().splitlines() if line.strip()] if metrics else []
    trained = [r for r in rows if r.get("iteration", 0) >= 1 and r.get("num_tokens")]
    return {
        "exit_code": code,
        "peak_rss_gb": tree.peak / GB,
        "episode_tokens_mean": [r.get("completion_len_mean") for r in trained],
        "wall_s": wall,
        "iteration_wall_s": [r.get("wall_s") for r in trained],
        "train_s": [r.get("busy_train_s") for r in trained],
        "generate_s": [r.get("busy_generate_s") for r in trained],
        "reported_peak_rss_gb": [r.get("peak_rss_gb") for r in rows],
        # each stage's own (the rows' fields; the code before issue 55 has none): which stage set the peak
        "generate_peak_rss_gb": [r.get("generate_peak_rss_gb") for r in trained],
        "train_peak_rss_gb": [r.get("train_peak_rss_gb") for r in trained],
        "command": " ".join(command[1:]),
    }


def breakdown(side: str, quick: bool) -> dict:
    """One side's stages in this process (the package on PYTHONPATH is that side's code): each
    stage's peak RSS, its RSS at the end and glibc's heap then, in GB."""
    stages: dict[str, dict] = {}
    with TreePeak() as tree:

        def stage(name: str, **extra) -> None:
            stages[name] = {"peak_gb": tree.restart() / GB, "rss_gb": tree.peak / GB, **heap(), **extra}

        stage("python")
        import flyte  # noqa: F401
        import peft  # noqa: F401
        import torch
        import transformers  # noqa: F401

        stage("libraries imported")
        import _common as common

        from grpo_flyte.config.run import RunConfig
        from grpo_flyte.data import train_eval_split
        from grpo_flyte.engine.cache import EngineKey, get_engine
        from grpo_flyte.learning import policy
        from grpo_flyte.learning import update as policy_update
        from grpo_flyte.models.embedded import embedded_model_dir
        from grpo_flyte.runtime.device import resolve_dtype
        from grpo_flyte.runtime.torch_thread import on_torch_thread

        settings = {"prompts_per_iter": 2, "group_size": 2, "max_new_tokens": 8} if quick else {}
        config = RunConfig(**settings)
        model_path = str(embedded_model_dir())
        adapter = Path(tempfile.mkdtemp(prefix="grpo_flyte-memory-adapter-"))
        dataset, _ = train_eval_split(config)
        key = EngineKey("hf", model_path, resolve_dtype(config.base.dtype), config.engine.adapter_cache_size, 0, 0)

        def generator():
            engine = get_engine(key)
            with torch.inference_mode():  # touch every weight, as the first decode does
                engine.base(input_ids=torch.tensor([[1, 2, 3]]))
            return engine

        engine = on_torch_thread(generator)
        stage("generator's base weights")

        def trainer():
            model = policy.peft_model(config.base, config.lora, model_path)
            policy.reset_lora(model, config.seed)
            policy.save_adapter(model, None, 0, adapter)
            with torch.no_grad():
                model(input_ids=torch.tensor([[1, 2, 3]]))
            return model

        model = on_torch_thread(trainer)
        stage("trainer's base weights")

        def rollouts(iteration: int) -> list:
            return common.every_rollout_sequences(engine, config, dataset, adapter, iteration)

        optimizer = None
        for iteration in range(1 if quick else 2):
            sequences = on_torch_thread(rollouts, iteration)
            stage(f"rollouts {iteration + 1}", tokens=sum(s.length for s in sequences))
            if optimizer is None:
                optimizer = on_torch_thread(policy.load_adapter_state, model, str(adapter), config.train)
            started = time.perf_counter()
            stats = on_torch_thread(policy_update.grpo_step, model, optimizer, sequences, config.train, config.sampling, (iteration, 2))
            stage(f"train step {iteration + 1}", seconds=time.perf_counter() - started, loss=stats.loss, grad_norm=stats.grad_norm)
    shutil.rmtree(adapter, ignore_errors=True)
    return {"micro_batch_tokens": config.train.micro_batch_tokens, "stages": stages}


def _breakdown_process(src: Path, side: str, quick: bool) -> dict:
    """`breakdown` of `side` in a fresh process with `src` on its path."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, __file__, "--stage", side] + (["--quick"] if quick else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} breakdown failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_breakdown(side: str, found: dict) -> None:
    print(f"\n{side} (micro_batch_tokens {found['micro_batch_tokens']}): stage, peak GB, RSS after, heap free kept")
    for name, s in found["stages"].items():
        print(f"  {name:<28} {s['peak_gb']:6.2f} {s['rss_gb']:6.2f} {s.get('heap_free_kept_gb', float('nan')):6.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "memory.json")
    p.add_argument(
        "--part",
        nargs="+",
        choices=("breakdown", *RUNS, "all"),
        default=["breakdown", "demo"],
        help="what to measure (all: the breakdown and every run)",
    )
    p.add_argument("--sides", nargs="+", choices=("before", "after"), default=["before", "after"])
    p.add_argument("--before", default=BEFORE_COMMIT, help="the commit of the code before (default %(default)s)")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--eval-size", type=int, default=16, help="held-out questions of the demo runs (the demo: 100)")
    p.add_argument("--merge", type=Path, help="an earlier JSON of this benchmark: its sides not measured now are kept")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # internal: one side's breakdown, in its own process
    args = p.parse_args(argv)
    if args.quick:
        args.sides = ["after"]  # the plumbing: this checkout's breakdown at a tiny size
    if args.stage:
        print(json.dumps(breakdown(args.stage, args.quick)))
        return 0
    _common.quiet_logs()
    result: dict = {"machine": _common.machine(), "before_commit": args.before, "breakdown": {}, "demo": {}}
    with tempfile.TemporaryDirectory(prefix="grpo_flyte-memory-") as tmp:
        sources = {"after": REPO / "src"}
        if "before" in args.sides:
            sources["before"] = before_checkout(args.before, Path(tmp))
        parts = ["breakdown", *RUNS] if "all" in args.part else args.part
        if "breakdown" in parts:
            for side in args.sides:
                result["breakdown"][side] = _breakdown_process(sources[side], side, args.quick)
                _print_breakdown(side, result["breakdown"][side])
        for name in [part for part in parts if part in RUNS and not args.quick]:
            flags, target = RUNS[name]
            for side in args.sides:
                run_dir = Path(tmp) / f"{name}-{side}"
                out = demo_run(sources[side], run_dir, args.iterations, args.eval_size, flags)
                result.setdefault(name, {})[side] = {**out, "target_gb": target}
                print(
                    f"{name} {side}: peak {out['peak_rss_gb']:.2f} GB over the tree (target {target or 'below the demo'}), "
                    f"wall {out['wall_s']:.0f} s, train {out['train_s']} s, exit {out['exit_code']}",
                    flush=True,
                )
    if args.merge:
        earlier = json.loads(args.merge.read_text())
        for part in ("breakdown", *RUNS):
            for side, found in earlier.get(part, {}).items():
                result.setdefault(part, {}).setdefault(side, {**found, "machine": earlier["machine"]})
    _common.write_result(_common.out_file(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
