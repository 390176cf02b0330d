"""Soak drill: many small iterations; resident memory and disk use must stay bounded.

Runs the real CLI (`python -m grpo_flyte.driver --local`) as a child process on a tiny random
model (same tokenizer as the embedded one, so the whole path is exercised in seconds per
iteration), samples the child's resident memory (RSS) and the run dir's size after each finished
iteration, and prints the growth per iteration over the second half of the run, after warm-up.
Exits 1 if either grows by more than the allowance, or the run does not finish.

    python benchmarks/soak.py                     # 120 iterations
    python benchmarks/soak.py --iterations 30     # a quicker look
    python benchmarks/soak.py --quick             # 6 iterations: the plumbing (growth not judged)
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

from grpo_flyte.models.embedded import embedded_model_dir

# The tiny random model the tests use lives with them (test scaffolding stays out of the package):
# tests/support/tiny_model.py, imported as the tests import it, from the checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.tiny_model import build_tiny_model

# Allowances per iteration over the second half: well above noise, far below a real leak (a leaked
# adapter version of the tiny model is ~0.1 MB on disk; a leaked engine or optimizer is MBs).
RSS_ALLOWANCE_MB = 0.5
DISK_ALLOWANCE_MB = 0.02


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def du_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 2**20


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares growth of ys per unit of xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--work-dir", type=Path, default=None, help="Where the tiny model and the run go (default: a temp dir).")
    parser.add_argument("--quick", action="store_true", help="6 iterations: the drill runs, too short to judge growth")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON of results goes (default: the work dir's soak.json)")
    args = parser.parse_args()
    if args.quick:
        args.iterations = 6

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="grpo-soak-"))
    model = build_tiny_model(work / "tiny-model", embedded_model_dir())
    run_dir = work / "run"
    cmd = [
        sys.executable,
        "-m",
        "grpo_flyte.driver",
        "--local",
        "--model",
        str(model),
        "--run-dir",
        str(run_dir),
        "--iterations",
        str(args.iterations),
        "--prompts-per-iter",
        "2",
        "--group-size",
        "3",
        "--max-new-tokens",
        "8",
        "--min-informative-groups",
        "0",
        "--eval-every",
        "10",
        "--eval-size",
        "4",
        "--adapters-to-keep",
        "3",
    ]
    print(f"soak: {args.iterations} iterations in {run_dir}", flush=True)
    started = time.monotonic()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: dict[int, tuple[float, float]] = {}  # iteration -> (rss MB, run dir MB)
    metrics = run_dir / "metrics.jsonl"
    while child.poll() is None:
        done = metrics.read_text().count("\n") - 1 if metrics.is_file() else -1  # minus the eval-0 row
        if done >= 1 and done not in samples:
            samples[done] = (rss_mb(child.pid), du_mb(run_dir))
            if done % 10 == 0:
                rss, disk = samples[done]
                print(f"  iter {done:4d}  rss {rss:7.1f} MB  run dir {disk:6.2f} MB  {time.monotonic() - started:6.0f} s", flush=True)
        time.sleep(0.2)
    if child.returncode != 0:
        print(f"soak: the run failed (exit {child.returncode}):\n{child.stderr.read()[-3000:]}")
        return 1
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    iterations = [r["iteration"] for r in rows if "mean_reward" in r]
    assert iterations == list(range(1, args.iterations + 1)), "an iteration is missing or recorded twice"

    half = sorted(i for i in samples if i > args.iterations // 2)
    rss_growth = slope([float(i) for i in half], [samples[i][0] for i in half])
    disk_growth = slope([float(i) for i in half], [samples[i][1] for i in half])
    adapters = sorted(p.name for p in (run_dir / "flyte" / "adapters").iterdir())
    result = {
        "iterations": args.iterations,
        "wall_s": round(time.monotonic() - started, 1),
        "rss_mb_first_last": [round(samples[min(samples)][0], 1), round(samples[max(samples)][0], 1)],
        "rss_growth_mb_per_iter": round(rss_growth, 4),
        "disk_mb_first_last": [round(samples[min(samples)][1], 2), round(samples[max(samples)][1], 2)],
        "disk_growth_mb_per_iter": round(disk_growth, 5),
        "adapter_versions_on_disk": adapters,
    }
    print(json.dumps(result, indent=2))
    bounded = rss_growth <= RSS_ALLOWANCE_MB and disk_growth <= DISK_ALLOWANCE_MB
    ok = (bounded or args.quick) and len(adapters) <= 3
    verdict = "not judged (--quick)" if args.quick else "bounded" if bounded else "GROWING"
    print(
        f"soak: {verdict}: rss {rss_growth:+.3f} MB/iter (allowed {RSS_ALLOWANCE_MB}), "
        f"disk {disk_growth:+.4f} MB/iter (allowed {DISK_ALLOWANCE_MB}), {len(adapters)} adapter versions kept"
    )
    (args.out or work / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
