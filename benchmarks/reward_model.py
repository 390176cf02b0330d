"""A reward model as a reward: one built from the embedded model, and a group's scoring against its generation.

The reward model is the embedded SmolLM2-135M-Instruct's decoder with a scalar head
(LlamaForSequenceClassification, num_labels=1), the head trained briefly on the arithmetic task:
pairs of completions of one training question, its right answer and a wrong one
('13 + 14 = 27.\\n#### 27' against '... = 26.\\n#### 26'), each read as the reward model reads a
completion (grpo_flyte.judge.conversations: the run's system prompt, the question with the
instruction, the completion as the assistant's turn). The decoder stays frozen: its last token's
hidden state is computed once per conversation, and the head w (the model's `score` layer) is
fitted to the pairs' Bradley-Terry loss, mean softplus(-(w.h_right - w.h_wrong)) plus an L2
penalty, by full-batch Adam on standardized features. `pair_accuracy` is the share of held-out pairs (questions from the held-out split) that the
saved model, loaded as a run loads it (grpo_flyte.models.reward_model), scores right above wrong.

Then, on held-out questions, each group once, in turn: the policy (the embedded model, the run's
transformers engine, its prompt) generates a group of `group_size` completions of at most
`max_new_tokens` tokens (`generate_s`), and the reward model scores that group in its one forward
(`score_s`, the body of reward_model_group without Flyte). `score_over_generate` is the median of
their per-group ratio.

    python benchmarks/reward_model.py            # 256 training pairs, 100 held-out, 8 groups of 8 x 64 tokens
    python benchmarks/reward_model.py --quick    # 16 pairs, 8 held-out, 2 groups of 2 x 8 tokens
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

import _common

from grpo_flyte.config.run import RunConfig
from grpo_flyte.models.embedded import embedded_model_dir

SEED = 0
WEIGHT_DECAY = 1e-3  # an L2 penalty on the head: 256 pairs in 576 dimensions fit exactly without one


def answer_text(question: str, value: str) -> str:
    """A completion stating `value` as the answer: the question's expression, then the final line."""
    expression = question.removeprefix("What is ").removesuffix("?")
    return f"{expression} = {value}.\n#### {value}"


def pairs(examples, num: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, right completion, wrong completion) for `num` examples: the wrong answer off by 1-10."""
    out = []
    for example in rng.sample(examples, num):
        right = int(example.answer)
        wrong = right + rng.choice([d for d in range(-10, 11) if d])
        out.append((example.question, answer_text(example.question, str(right)), answer_text(example.question, str(wrong))))
    return out


def conversation(config: RunConfig, question: str, completion: str) -> list[dict[str, str]]:
    from grpo_flyte.engine.prompts import prompt_messages
    from grpo_flyte.types import Example

    return [*prompt_messages(Example(question=question, answer=""), config.prompt), {"role": "assistant", "content": completion}]


def last_hidden(model, tokenizer, conversations: list[list[dict[str, str]]]):
    """(N, hidden) hidden states of each conversation's last token, as the model's score head reads them."""
    import torch

    from grpo_flyte.models.reward_model import token_ids

    rows = []
    with torch.inference_mode():
        for c in conversations:
            ids = torch.tensor([token_ids(tokenizer, c)])
            rows.append(model.model(input_ids=ids).last_hidden_state[0, -1])
    return torch.stack(rows)


def build_reward_model(config: RunConfig, out: Path, train_pairs, steps: int) -> dict:
    """The embedded model with a trained scalar head, saved to `out` as a reward model folder."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    base = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = LlamaForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32).eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    with _common.Stopwatch() as features:
        right = last_hidden(model, tokenizer, [conversation(config, q, r) for q, r, _ in train_pairs])
        wrong = last_hidden(model, tokenizer, [conversation(config, q, w) for q, _, w in train_pairs])
    torch.manual_seed(SEED)
    head = torch.zeros(right.shape[1], requires_grad=True)
    # the head is fitted on standardized features (hidden units differ in scale by orders of
    # magnitude), then divided by their scales: w.h = head.(h / std); a shift of every score
    # by a constant (no bias: the score layer has none) changes no pair's order nor a group's advantages
    std = torch.cat([right, wrong]).std(dim=0) + 1e-6
    differences = (right - wrong) / std
    optimizer = torch.optim.Adam([head], lr=5e-2)
    with _common.Stopwatch() as fit:
        for _ in range(steps):
            loss = torch.nn.functional.softplus(-(differences @ head)).mean() + WEIGHT_DECAY * head.square().sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        model.score.weight.copy_((head / std).unsqueeze(0))
        train_accuracy = ((right - wrong) @ model.score.weight[0] > 0).float().mean().item()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"train_loss": loss.item(), "train_pair_accuracy": train_accuracy, "features_s": features.s, "fit_s": fit.s}


async def time_groups(config: RunConfig, reward_model_path: Path, questions, dtype: str) -> list[dict]:
    """Each question's group generated by the policy, then scored by the reward model: seconds of each."""
    from grpo_flyte.engine import cache
    from grpo_flyte.engine.interface import SamplingRequest
    from grpo_flyte.engine.prompts import tokenize_prompt
    from grpo_flyte.judge import conversations
    from grpo_flyte.models.reward_model import RewardModelKey, get_reward_model
    from grpo_flyte.runtime.torch_thread import run_on_torch_thread
    from grpo_flyte.types import RolloutGroup

    key = cache.engine_key(str(embedded_model_dir()), dtype, "hf", 1, "", 0)
    engine = await run_on_torch_thread(cache.get_engine, key)
    scorer = await run_on_torch_thread(get_reward_model, RewardModelKey(str(reward_model_path), dtype))
    sampling = config.sampling
    out = []
    for i, example in enumerate(questions):
        ids = tokenize_prompt(engine.tokenizer, example, config.prompt)
        request = SamplingRequest(
            prompt_ids=ids, group_size=sampling.group_size, temperature=sampling.temperature, top_p=1.0,
            max_new_tokens=sampling.max_new_tokens, seed=SEED + i,
        )  # fmt: skip
        with _common.Stopwatch() as generating:
            [rollouts] = await run_on_torch_thread(engine.generate_many, [request], None)
        group = RolloutGroup(index=i, example=example, adapter_version=0, prompt_ids=ids, rollouts=rollouts, generate_s=generating.s)
        with _common.Stopwatch() as scoring:
            scores = await run_on_torch_thread(scorer.score, conversations(group, config.prompt))
        tokens = sum(len(r.completion_ids) for r in rollouts)
        out.append({"generate_s": generating.s, "score_s": scoring.s, "completion_tokens": tokens, "scores": scores})
        print(f"  group {i + 1}/{len(questions)}: generate {generating.s:.2f} s ({tokens} tokens), score {scoring.s:.3f} s")
        _common.flush()
    return out


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__, "reward_model.json")
    args = p.parse_args(argv)
    _common.quiet_logs()
    from grpo_flyte.data import arithmetic_split
    from grpo_flyte.models.reward_model import RewardModel, RewardModelKey
    from grpo_flyte.runtime.device import resolve_dtype

    num_train, num_held, groups, group_size, tokens, steps = (16, 8, 2, 2, 8, 50) if args.quick else (256, 100, 8, 8, 64, 300)
    config = RunConfig(group_size=group_size, max_new_tokens=tokens)
    dtype = resolve_dtype(config.base.dtype)
    rng = random.Random(SEED)
    train_pairs = pairs(arithmetic_split("train"), num_train, rng)
    held_examples = arithmetic_split("eval")
    held_pairs = pairs(held_examples, num_held, rng)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "arithmetic-reward-model"
        print(f"training the head on {num_train} pairs ({steps} steps) ...")
        fit = build_reward_model(config, folder, train_pairs, steps)
        scorer = RewardModel(RewardModelKey(str(folder), dtype))
        right = scorer.score([conversation(config, q, r) for q, r, _ in held_pairs])
        wrong = scorer.score([conversation(config, q, w) for q, _, w in held_pairs])
        accuracy = statistics.fmean(a > b for a, b in zip(right, wrong, strict=True))
        print(f"held-out pairs scored right above wrong: {accuracy:.1%} of {num_held} (training pairs: {fit['train_pair_accuracy']:.1%})")
        print(f"{groups} groups of {group_size} x {tokens} tokens: generated by the policy, scored by the reward model ...")
        timed = asyncio.run(time_groups(config, folder, rng.sample(held_examples, groups), dtype))
    ratios = [t["score_s"] / t["generate_s"] for t in timed]
    summary = {
        "generate_s_median": statistics.median(t["generate_s"] for t in timed),
        "score_s_median": statistics.median(t["score_s"] for t in timed),
        "score_over_generate": statistics.median(ratios),
        "score_over_generate_max": max(ratios),
    }
    print(
        f"\na group's scoring: median {summary['score_s_median']:.3f} s against its generation's {summary['generate_s_median']:.2f} s: "
        f"{summary['score_over_generate']:.3f}x (at most {summary['score_over_generate_max']:.3f}x)"
    )
    settings = dict(
        train_pairs=num_train, held_out_pairs=num_held, head_steps=steps, groups=groups, group_size=group_size, max_new_tokens=tokens
    )
    _common.write_result(
        _common.out_file(args),
        {
            "benchmark": "reward_model",
            "machine": _common.machine(),
            "dtype": dtype,
            "settings": settings,
            "head": {**fit, "held_out_pair_accuracy": accuracy},
            "groups": timed,
            **summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
