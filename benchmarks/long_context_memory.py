"""Long observations: peak memory per token held, generating and training, before and after issue 40.

A tool that returns a web page or a file puts thousands of tokens into an episode at once. This
measures, on the embedded SmolLM2-135M-Instruct in bfloat16, the peak resident memory above the
loaded model's (the process's high-water mark, reset once the model is loaded) of
- generation: the transformers engine (`HFGenerator.generate_many`) given one context of N
  tokens of a 20,000-character page (7,284 tokens: "row 48213: the river runs past the mill. ..."),
  sampling 16 tokens: the prefill of a long observation, then decode steps;
- training: one GRPO step (`policy_update.grpo_step`, default config: --micro-batch-tokens 4096) on
  an episode of N tokens: a 32-token prompt, the page, 16 of the model's tokens (the trained ones).

"after" is this checkout; "before" sets the knobs back to main's code before issue 40: every
attention call through `attention.grouped_attention`'s own arithmetic (a queries x keys scores
matrix per head), the context prefilled in one pass, no checkpointing past --micro-batch-tokens.
Each case runs in a fresh process (--quick: each side's cases in one, on the tests' tiny random
model); the ratio before / after is taken at the same N, in one run.
Memory per 1,000 tokens that stays flat as N grows is memory linear in the tokens (the key/value
cache: 23 KB a token on this model in bfloat16); one that grows with N is quadratic.

    python benchmarks/long_context_memory.py            # the figures in docs/measurements.md (~15 minutes)
    python benchmarks/long_context_memory.py --quick    # seconds: the plumbing only, on the tests' tiny random model (CI)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _common

# Tokens held per case. "before" stays under ~4 GB above the model here (its memory is quadratic:
# 7,284 tokens would be ~4 GB for the prefill alone and ~150 GB for the train step).
FULL = {
    "generate": {"before": [1000, 2000, 4000], "after": [1000, 2000, 4000, 7284, 14568]},
    "train": {"before": [500, 1000], "after": [500, 1000, 2000, 6000]},
}
QUICK = {"generate": {"before": [200], "after": [200]}, "train": {"before": [100], "after": [100]}}
NEW_TOKENS = 16
MODEL_TOKENS = 16  # the trained episode's own tokens
PAGE_CHARS = 20_000


def page_ids(tokenizer, num: int) -> list[int]:
    """`num` token ids of long pages, one after another (a 20,000-character page is 7,284 tokens)."""
    page = "".join(f"row {i * 7919 % 100000}: the river runs past the mill. " for i in range(PAGE_CHARS // 20))[:PAGE_CHARS]
    ids = tokenizer(page, add_special_tokens=False)["input_ids"]
    return (ids * (num // len(ids) + 1))[:num]


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS: resident now, VmHWM: the high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _before() -> None:
    """main's behaviour before issue 40: eager-style attention everywhere, one-pass prefill, no automatic checkpointing."""
    from grpo_flyte.engine import prefix_cache
    from grpo_flyte.learning import update as policy_update
    from grpo_flyte.models import attention

    attention.GROUPED_SCORES_LIMIT = float("inf")
    prefix_cache.PREFILL_CHUNK_TOKENS = 2**40
    policy_update.checkpointed = lambda train, lengths: train.gradient_checkpointing


def measure(case: str, side: str, num: int, model_path: str) -> dict:
    """One case in this process: the peak bytes above the loaded model's resident memory."""
    from grpo_flyte.config.run import RunConfig
    from grpo_flyte.engine.hf_generator import HFGenerator
    from grpo_flyte.engine.interface import SamplingRequest
    from grpo_flyte.learning import grpo, policy
    from grpo_flyte.learning import update as policy_update

    if side == "before":
        _before()
    if case == "generate":
        generator = HFGenerator(model_path, "bfloat16", 1)
        ids = page_ids(generator.tokenizer, num - NEW_TOKENS)
        request = SamplingRequest(prompt_ids=ids, group_size=1, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS, seed=0)

        def work():
            generator.generate_many([request], None)
    else:
        from transformers import AutoTokenizer

        config = RunConfig(dtype="bfloat16", eval_size=0)
        model = policy.peft_model(config.base, config.lora, model_path)
        policy.reset_lora(model, config.seed)
        optimizer = policy._optimizer(model, config.train)
        ids = page_ids(AutoTokenizer.from_pretrained(model_path), num)
        observation = num - 32 - MODEL_TOKENS
        sequence = grpo.TrainSequence(ids[:32], ids[32:], 1.0, None, False, (False,) * observation + (True,) * MODEL_TOKENS)

        def work():
            policy_update.grpo_step(model, optimizer, [sequence], config.train, config.sampling)

    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    start = _status("VmRSS")
    work()
    peak = _status("VmHWM")
    return {"case": case, "side": side, "tokens": num, "model_rss_bytes": start, "peak_above_model_bytes": peak - start}


def run_cases(side: str, cases: list[tuple[str, int]], model_path: str) -> list[dict]:
    """(case, tokens) of one side, one after another in a fresh process of their own."""
    argv = [sys.executable, __file__, "--one", side, model_path, *(f"{case}:{num}" for case, num in cases)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        return [{"case": case, "side": side, "tokens": num, "error": (done.stdout + done.stderr)[-2000:]} for case, num in cases]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(cases) :]]


def table(results: list[dict], case: str) -> tuple[list[str], list[dict]]:
    """The printed lines and the ratios (before / after at the same tokens) of one case."""
    by = {(r["side"], r["tokens"]): r for r in results if r["case"] == case and "error" not in r}
    lines = [f"{case}: tokens  before MB (per 1k tokens)   after MB (per 1k tokens)   before/after"]
    ratios = []
    for num in sorted({n for _, n in by}):
        cells = []
        for side in ("before", "after"):
            r = by.get((side, num))
            cells.append(
                f"{r['peak_above_model_bytes'] / 2**20:8.0f} ({r['peak_above_model_bytes'] / 2**20 / num * 1000:6.1f})" if r else " " * 17
            )
        ratio = ""
        if (b := by.get(("before", num))) and (a := by.get(("after", num))):
            x = b["peak_above_model_bytes"] / max(1, a["peak_above_model_bytes"])
            ratios.append({"tokens": num, "before_over_after": x})
            ratio = f"{x:6.1f}x"
        lines.append(f"{num:>15}  {cells[0]}          {cells[1]}          {ratio}")
    return lines, ratios


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:  # --one SIDE MODEL CASE:TOKENS ...
        _common.quiet_logs()
        for one in argv[3:]:
            case, num = one.split(":")
            print(json.dumps(measure(case, argv[1], int(num), argv[2])), flush=True)
        return 0
    p = _common.parser(__doc__, "long_context_memory.json")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.quick:
        model_path = str(_common.quick_model())
    else:
        from grpo_flyte.models.embedded import embedded_model_dir

        model_path = str(embedded_model_dir())
    # a process per case; --quick: a process per side (the plumbing, with two imports fewer)
    batches = [(side, [(case, num)]) for case, sides in plan.items() for side, sizes in sides.items() for num in sizes]
    if args.quick:
        batches = [(side, [c for s, cs in batches if s == side for c in cs]) for side in ("before", "after")]
    results = []
    for side, cases in batches:
        for r in run_cases(side, cases, model_path):
            results.append(r)
            shown = f"{r['peak_above_model_bytes'] / 2**20:.0f} MB above the model" if "error" not in r else "FAILED\n" + r["error"]
            print(f"{r['case']:8} {side:6} {r['tokens']:6} tokens: {shown}", flush=True)
    print()
    summary = {}
    for case in plan:
        lines, ratios = table(results, case)
        print("\n".join(lines) + "\n")
        summary[case] = ratios
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "long_context_memory",
            "machine": _common.machine(),
            "model": (_common.QUICK_MODEL if args.quick else "SmolLM2-135M-Instruct (embedded)") + ", bfloat16",
            "new_tokens": NEW_TOKENS,
            "results": results,
            "before_over_after": summary,
        },
    )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
