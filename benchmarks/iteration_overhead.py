"""What does running GRPO as Flyte tasks cost? One iteration in local mode vs the same work as plain calls.

Each round runs both sides once, alternately (the order flips every round), on the embedded
SmolLM2-135M-Instruct with the default config (8 prompts x 8 completions, up to 64 new tokens,
top-up to 4 informative groups) and no held-out evaluation:

- flyte: `train_rl` for one iteration in Flyte local mode, as `python -m grpo_flyte.driver --local
  --iterations 1` runs it: the init_adapter, generate, score_group and train_step tasks,
  checkpoint, metrics, report and adapter export, and the run's own start-up.
- bare: the same init + iteration as direct calls to the same generator, reward and trainer.

Both sides start from the same fresh adapter with the same seeds, so they do identical work; the
benchmark checks that (the trained adapters must be bit-identical). Model loading is excluded: one
warm-up run per side first. Prints the median of the per-round ratios flyte / bare.

    python benchmarks/iteration_overhead.py              # 3 rounds, ~8 minutes on a 2-core CPU
    python benchmarks/iteration_overhead.py --quick      # the plumbing: the tests' tiny model, tiny sizes, 1 round, no warm-up
"""

from __future__ import annotations

import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
from _loops import bare_iteration, flyte_iteration, same_adapter

from grpo_flyte.config.run import RunConfig
from grpo_flyte.learning import update as policy_update
from grpo_flyte.models.embedded import embedded_model_dir
from grpo_flyte.runtime.device import resolve_dtype
from grpo_flyte.runtime.torch_thread import on_torch_thread

TARGET = 1.05


def record_grpo_steps() -> list[dict]:
    """Wrap policy_update.grpo_step (both sides call it) to record each call's seconds and the process's
    minor page faults during it: the gap between the sides was in this step, ~590,000 faults a step
    inside the Flyte task until the torch thread kept its memory (docs/measurements.md, "Iteration
    overhead"; grpo_flyte/runtime/allocator.py); both sides now fault about equally."""
    calls: list[dict] = []
    original = policy_update.grpo_step

    def recorded(*args, **kwargs):
        faults, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            calls.append({"s": time.perf_counter() - started, "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})

    policy_update.grpo_step = recorded
    return calls


class Usage:
    """The process's CPU seconds (every thread; not the reward workers' processes) and minor page
    faults over a block: a side's work measured in counts that do not depend on the machine's load."""

    def __enter__(self) -> Usage:
        self.cpu, self.faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return self

    def __exit__(self, *exc) -> None:
        self.cpu = time.process_time() - self.cpu
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults


def last(steps: list[dict], first: int) -> dict | None:
    return steps[-1] if len(steps) > first else None


def step_fields(new: list[dict]) -> dict:
    """The side's grpo_step seconds and faults (0 when it trained on nothing)."""
    return {"grpo_step_s": sum(c["s"] for c in new), "grpo_step_faults": sum(c["minor_faults"] for c in new)}


def step_note(step: dict | None) -> str:
    if step is None:
        return "no grpo_step (no rollout with a nonzero advantage)"
    return f"grpo_step {step['s']:.1f} s, {step['minor_faults'] / 1000:.0f}k minor page faults"


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "iteration_overhead.json")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (flyte, bare), order alternating")
    args = p.parse_args(argv)
    _common.quiet_logs()
    sizes = {"prompts_per_iter": 2, "group_size": 2, "max_new_tokens": 16, "min_informative_groups": 0} if args.quick else {}
    rounds = 1 if args.quick else args.rounds
    model_dir = _common.quick_model() if args.quick else embedded_model_dir()
    config = RunConfig(iterations=1, eval_size=0, **sizes, **({"model": str(model_dir)} if args.quick else {}))
    # Warm-up: the same engine and training model (their caches are keyed on these fields), tiny work.
    warm = RunConfig(**{**config.flat(), "prompts_per_iter": 2, "group_size": 2, "min_informative_groups": 0})
    root = Path(tempfile.mkdtemp(prefix="grpo_flyte-overhead-"))
    counter = iter(range(10_000))
    result = {"benchmark": "iteration_overhead", "machine": _common.machine(), "config": config.flat()}
    adapters: dict[str, list[str]] = {"flyte": [], "bare": []}
    steps = record_grpo_steps()

    def flyte_side(cfg: RunConfig = config) -> dict:
        run_dir = root / f"flyte-{next(counter)}"
        first = len(steps)
        started = time.perf_counter()
        with Usage() as used:
            out = flyte_iteration(cfg, model_dir, run_dir)
        s = time.perf_counter() - started
        adapters["flyte"].append(out["adapter_dir"])
        row = out["row"]
        return {
            "s": s,
            "cpu_s": used.cpu,
            "minor_faults": used.faults,
            "iteration_s": row["iteration_s"],
            "generate_s": row["generate_s"],
            "train_s": row["train_s"],
            "loss": row["loss"],
            "num_groups": row["num_groups"],
            "completion_tokens": round(row["completion_len_mean"] * row["num_rollouts"]),
            **step_fields(steps[first:]),
            "note": f"iteration {row['iteration_s']:.1f} s inside the run, {row['num_groups']} groups; {step_note(last(steps, first))}",
        }

    def bare_side(cfg: RunConfig = config) -> dict:
        out_dir = root / f"bare-{next(counter)}"
        first = len(steps)
        started = time.perf_counter()
        # On the thread grpo_flyte's tasks run torch on: two threads driving torch slow both.
        with Usage() as used:
            out = on_torch_thread(bare_iteration, cfg, model_dir, out_dir)
        s = time.perf_counter() - started
        adapters["bare"].append(out["adapter_dir"])
        return {
            "s": s,
            "cpu_s": used.cpu,
            "minor_faults": used.faults,
            "loss": out["stats"].loss,
            "num_groups": len(out["scored"]),
            "completion_tokens": sum(len(r.completion_ids) for sg in out["scored"] for r in sg.group.rollouts),
            **step_fields(steps[first:]),
            "note": f"{len(out['scored'])} groups; {step_note(last(steps, first))}",
        }

    try:
        if not args.quick:  # --quick: the plumbing, which the round runs all of (the warm-up's work is the round's there)
            print(f"warm-up (model loading, excluded): {model_dir.name}, {resolve_dtype(config.base.dtype)}")
            with _common.Stopwatch() as w:
                flyte_side(warm)
                bare_side(warm)
            print(f"  {w.s:.1f} s")
        adapters = {"flyte": [], "bare": []}
        print(
            f"{rounds} rounds of one iteration: {config.prompts_per_iter} prompts x {config.sampling.group_size} completions, "
            f"up to {config.sampling.max_new_tokens} new tokens, top-up to {config.min_informative_groups} informative groups"
        )
        runs = _common.alternate({"flyte": flyte_side, "bare": bare_side}, rounds)
        identical = [same_adapter(a, b) for a, b in zip(adapters["flyte"], adapters["bare"], strict=True)]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratios = _common.paired_ratios(runs["flyte"], runs["bare"])
    ratio = statistics.median(ratios)
    flyte_s, bare_s = _common.median_s(runs["flyte"]), _common.median_s(runs["bare"])
    inside = _common.median_s(runs["flyte"], "iteration_s")
    result.update(
        runs=runs,
        ratios=ratios,
        ratio=ratio,
        flyte_s=flyte_s,
        bare_s=bare_s,
        flyte_iteration_s=inside,
        identical_adapters=identical,
        target=TARGET,
    )
    print(
        f"\nflyte / bare = {ratio:.3f}x (median of per-round ratios {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"{_common.verdict(ratio, TARGET)}"
    )
    print(
        f"  grpo_step (median): flyte {_common.median_s(runs['flyte'], 'grpo_step_s'):.2f} s with "
        f"{statistics.median(r['grpo_step_faults'] for r in runs['flyte']) / 1000:.0f}k minor page faults, bare "
        f"{_common.median_s(runs['bare'], 'grpo_step_s'):.2f} s with {statistics.median(r['grpo_step_faults'] for r in runs['bare']) / 1000:.0f}k"
    )
    print(
        f"  the whole side (median): flyte {_common.median_s(runs['flyte'], 'cpu_s'):.2f} s of CPU with "
        f"{statistics.median(r['minor_faults'] for r in runs['flyte']) / 1000:.0f}k minor page faults, bare "
        f"{_common.median_s(runs['bare'], 'cpu_s'):.2f} s with {statistics.median(r['minor_faults'] for r in runs['bare']) / 1000:.0f}k"
    )
    print(
        f"  flyte {flyte_s:.2f} s per run (median; of it {inside:.2f} s is run_iteration, the rest init_adapter, "
        f"checkpoint, report, export and the run's start-up), bare {bare_s:.2f} s"
    )
    print(
        f"  identical work: trained adapters bit-identical in {sum(identical)}/{len(identical)} rounds; "
        f"losses flyte {[round(r['loss'], 6) for r in runs['flyte']]} bare {[round(r['loss'], 6) for r in runs['bare']]}"
    )
    _common.write_result(_common.out_file(args), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
