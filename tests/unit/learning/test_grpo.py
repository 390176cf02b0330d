"""Unit tests for the GRPO math in grpo_flyte.learning.grpo (CPU torch, hand-computed expectations)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from grpo_flyte.learning import grpo
from grpo_flyte.learning.grpo import (
    TrainSequence,
    group_advantages,
    pad_batch,
    plan_micro_batches,
    split_minibatches,
    token_logprobs,
    token_logprobs_and_entropy,
)
from grpo_flyte.learning.losses import importance_weights

EPS = 1e-4


# --------------------------------------------------------------------------- group_advantages


def test_group_advantages_two_right_two_wrong():
    # rewards [1, 0, 0, 1]: mean = 2/4 = 0.5; deviations +-0.5; sample variance
    # = (4 * 0.25) / (4 - 1) = 1/3 -> std = 0.57735; A = +-0.5 / (std + eps)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], EPS)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert adv == pytest.approx([a, -a, -a, a], rel=1e-12)


def test_group_advantages_sample_std_by_default_population_on_request():
    # rewards [2, 0, 1]: mean 1; deviations [1, -1, 0]; sample variance (1 + 1 + 0) / 2 = 1 (TRL,
    # verl: torch.std's default); population variance (1 + 1 + 0) / 3 = 2/3
    assert group_advantages([2.0, 0.0, 1.0], EPS) == pytest.approx([1 / (1 + EPS), -1 / (1 + EPS), 0.0], rel=1e-12)
    std = math.sqrt(2.0 / 3.0)
    population = group_advantages([2.0, 0.0, 1.0], EPS, std="population")
    assert population == pytest.approx([1.0 / (std + EPS), -1.0 / (std + EPS), 0.0], rel=1e-12)
    # and the same as torch's unbiased std, which TRL calls
    r = torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)
    assert group_advantages(r.tolist(), EPS) == pytest.approx(((r - r.mean()) / (r.std() + EPS)).tolist(), rel=1e-12)
    with pytest.raises(ValueError, match="'sample' or 'population'"):
        group_advantages([1.0, 0.0], EPS, std="biased")


def test_group_advantages_eps_is_added_to_std():
    # rewards [1, 0]: mean 0.5, population std 0.5; with eps = 0.5 the advantages are +-0.5 / 1.0
    assert group_advantages([1.0, 0.0], 0.5, std="population") == pytest.approx([0.5, -0.5], rel=1e-12)
    # sample std sqrt(0.5) = 0.7071
    assert group_advantages([1.0, 0.0], 0.5) == pytest.approx([0.5 / (math.sqrt(0.5) + 0.5), -0.5 / (math.sqrt(0.5) + 0.5)], rel=1e-12)


@pytest.mark.parametrize("rewards", [[0.0, 0.0, 0.0], [1.2, 1.2], [0.1, 0.1, 0.1], [7.0]])
def test_group_advantages_zero_spread_is_exactly_zero(rewards):
    # 0.1 + 0.1 + 0.1 != 0.3 in floating point: a mean-subtracting implementation would give tiny
    # nonzero values divided by (0 + eps), i.e. spurious signal. They must be exactly 0.
    adv = group_advantages(rewards, EPS)
    assert adv == [0.0] * len(rewards)
    assert all(a == 0.0 for a in adv)


def test_group_advantages_without_std_scaling_dr_grpo():
    # rewards [1, 0, 0, 1]: A = r - 0.5, not divided by the std (0.5)
    assert group_advantages([1.0, 0.0, 0.0, 1.0], EPS, scale_by_std=False) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.2, 0.2, 0.2], EPS, scale_by_std=False) == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert group_advantages([0.1, 0.1, 0.1], EPS, scale_by_std=False) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_group_advantages_non_finite_raises(bad):
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, bad, 0.0], EPS)


def test_group_advantages_empty():
    assert group_advantages([], EPS) == []


def test_group_advantages_sum_to_zero_and_keep_order():
    rewards = [0.2, 1.2, 0.0, 1.0, 0.2]
    adv = group_advantages(rewards, EPS)
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    # the order of advantages follows the order of rewards
    assert sorted(range(5), key=lambda i: adv[i]) == sorted(range(5), key=lambda i: (rewards[i], i))


# --------------------------------------------------------------------------- plan_micro_batches


def test_plan_micro_batches_hand_example():
    # lengths [3, 10, 5, 10, 2], budget 20. Longest first (ties by index): 1, 3, 2, 0, 4.
    # [1]; +3: 10*2 = 20 <= 20 -> [1, 3]; +2: 10*3 = 30 > 20 -> close; [2]; +0: 5*2 = 10;
    # +4: 5*3 = 15 -> [2, 0, 4]
    assert plan_micro_batches([3, 10, 5, 10, 2], 20) == [[1, 3], [2, 0, 4]]


def test_plan_micro_batches_oversize_sequence_alone():
    # 50 > 16: alone. Then [1]; +2: 4*2 = 8 <= 16 -> [1, 2]
    assert plan_micro_batches([50, 4, 4], 16) == [[0], [1, 2]]
    # two oversize sequences do not share a batch: 50 * 2 > 16
    assert plan_micro_batches([40, 50], 16) == [[1], [0]]


def test_plan_micro_batches_empty():
    assert plan_micro_batches([], 100) == []


def test_plan_micro_batches_properties_random():
    rng = random.Random(1234)
    for _ in range(50):
        n = rng.randint(1, 40)
        lengths = [rng.randint(1, 120) for _ in range(n)]
        budget = rng.randint(64, 512)
        batches = plan_micro_batches(lengths, budget)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(n)), "every index exactly once"
        for b in batches:
            assert b, "no empty batch"
            longest = max(lengths[i] for i in b)
            assert len(b) == 1 or longest * len(b) <= budget, (lengths, budget, b)
            # within a batch, longest first
            assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
        # batches are in length order: everything in batch k is >= everything in batch k+1
        for b1, b2 in itertools.pairwise(batches):
            assert min(lengths[i] for i in b1) >= max(lengths[i] for i in b2)


# --------------------------------------------------------------------------- pad_batch

PAD = EOS = 2  # a tokenizer whose pad token is its EOS token


def _two_rows():
    a = TrainSequence(prompt_ids=[5, 6, 7], completion_ids=[8, EOS], advantage=1.0)  # P=3, C=2
    b = TrainSequence(prompt_ids=[9], completion_ids=[EOS], advantage=-1.0)  # P=1, C=1 (just EOS)
    return a, b


def test_pad_batch_layout_and_mask_with_pad_equal_eos():
    a, b = _two_rows()
    batch = pad_batch([a, b], pad_id=PAD)
    # width = max(3 + 2, 1 + 1) = 5
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, EOS], [9, EOS, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # predict_mask covers t in [P-1, P+C-2]: row a: 2..3; row b: 0..0
    assert batch.predict_mask.tolist() == [
        [False, False, True, True, False],
        [True, False, False, False, False],
    ]
    assert batch.predict_mask.dtype == torch.bool
    # position t predicts token t+1: row a targets at 2, 3 are 8, EOS; row b target at 0 is EOS
    assert batch.targets[0, 2].item() == 8
    assert batch.targets[0, 3].item() == EOS
    assert batch.targets[1, 0].item() == EOS
    # the selected targets are exactly the completion tokens, EOS (== pad id) included
    assert batch.targets[batch.predict_mask].tolist() == [8, EOS, EOS]
    assert batch.row_of_token.tolist() == [0, 0, 1]


def test_pad_batch_mask_counts_match_completion_lengths():
    rng = random.Random(7)
    seqs = [
        TrainSequence(
            prompt_ids=[rng.randint(3, 50) for _ in range(rng.randint(1, 6))],
            completion_ids=[rng.randint(3, 50) for _ in range(rng.randint(1, 6))] + [PAD],
            advantage=1.0,
        )
        for _ in range(6)
    ]
    batch = pad_batch(seqs, pad_id=PAD)
    for row, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        expected = [p - 1 <= t <= p + c - 2 for t in range(batch.predict_mask.shape[1])]
        assert batch.predict_mask[row].tolist() == expected
        assert batch.targets[row][batch.predict_mask[row]].tolist() == s.completion_ids
        assert (batch.row_of_token == row).sum().item() == c
    assert batch.row_of_token.shape[0] == batch.predict_mask.sum().item()


@pytest.mark.parametrize(
    "seq",
    [
        TrainSequence(prompt_ids=[1, 2], completion_ids=[], advantage=1.0),
        TrainSequence(prompt_ids=[], completion_ids=[3], advantage=1.0),
    ],
)
def test_pad_batch_rejects_empty_prompt_or_completion(seq):
    with pytest.raises(ValueError):
        pad_batch([seq], pad_id=0)


# --------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_by_hand_with_temperature_2():
    logits = torch.tensor([[1.0, 2.0, 3.0], [2.0, 0.0, -2.0]])
    targets = torch.tensor([2, 0])
    out = token_logprobs(logits, targets, temperature=2.0)
    # row 0: logits / 2 = [0.5, 1, 1.5]; target 2 -> 1.5 - log(e^0.5 + e^1 + e^1.5)
    # row 1: logits / 2 = [1, 0, -1];   target 0 -> 1 - log(e^1 + e^0 + e^-1)
    expected = [
        1.5 - math.log(math.exp(0.5) + math.exp(1.0) + math.exp(1.5)),
        1.0 - math.log(math.exp(1.0) + 1.0 + math.exp(-1.0)),
    ]
    assert out.shape == (2,)
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    ref = torch.log_softmax(logits / 2.0, dim=-1)[torch.arange(2), targets]
    assert torch.allclose(out, ref)
    # temperature matters: at T=1 row 0 would be 3 - log(e + e^2 + e^3)
    t1 = 3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert out[0].item() != pytest.approx(t1, abs=1e-3)


def test_token_logprobs_is_float32_for_low_precision_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = token_logprobs(logits, torch.tensor([1]), temperature=1.0)
    assert out.dtype == torch.float32
    expected = 2.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert out.item() == pytest.approx(expected, abs=1e-6)


def test_token_logprobs_and_entropy_hand_computed():
    # p = [1/4, 3/4] at T = 1: H = -(1/4 ln 1/4 + 3/4 ln 3/4); uniform over 4: H = ln 4
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    logits4 = torch.zeros(1, 4)
    lp, h = token_logprobs_and_entropy(logits, torch.tensor([1, 0]), temperature=1.0)
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.5)], abs=1e-6)
    assert h[0].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    assert h[1].item() == pytest.approx(math.log(2), abs=1e-6)
    assert token_logprobs_and_entropy(logits4, torch.tensor([2]), 1.0)[1].item() == pytest.approx(math.log(4), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("through", ["logprobs", "entropy", "both"])
def test_token_logprobs_and_entropy_chunks_match_the_whole_matrix(monkeypatch, temperature, through):
    # 7 rows of 5 logits, 2 rows per chunk (the last chunk short): the values, the entropy and the
    # gradient (through the log-probs, the entropy or both) equal log_softmax over the whole
    # matrix, in float64.
    import grpo_flyte.learning.grpo as grpo_module

    monkeypatch.setattr(grpo_module, "VOCAB_CHUNK_ELEMENTS", 10)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    targets = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    weights = torch.randn(7, generator=gen, dtype=torch.float64)
    h_weights = torch.randn(7, generator=gen, dtype=torch.float64)

    def objective(lp, h):
        return {"logprobs": (lp * weights).sum(), "entropy": (h * h_weights).sum()}.get(through, (lp * weights + h * h_weights).sum())

    lp, h = token_logprobs_and_entropy(logits, targets, temperature)
    objective(lp, h).backward()
    whole = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(whole / temperature, dim=-1)
    expected = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    objective(expected, entropy).backward()
    assert lp.dtype == torch.float64
    assert torch.allclose(lp, expected, atol=1e-12)
    assert torch.allclose(h, entropy, atol=1e-12)
    assert torch.allclose(logits.grad, whole.grad, atol=1e-12)


def test_token_logprobs_and_entropy_bfloat16_logits_in_float32():
    # The trainer's logits are bfloat16: the arithmetic is float32 and the gradient bfloat16.
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]], dtype=torch.bfloat16, requires_grad=True)
    lp, _ = token_logprobs_and_entropy(logits, torch.tensor([1, 0]), temperature=1.0)
    lp.sum().backward()
    assert lp.dtype == torch.float32
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.5)], abs=1e-2)
    # d log p_t / d logits = onehot_t - p: row 0 (p = 1/4, 3/4), row 1 (1/2, 1/2)
    assert logits.grad.dtype == torch.bfloat16
    assert logits.grad.float().tolist() == [pytest.approx([-0.25, 0.25], abs=1e-2), pytest.approx([0.5, -0.5], abs=1e-2)]


# --------------------------------------------------------------------------- minibatches


@pytest.mark.parametrize(
    ("n", "k", "expected"),
    [(5, 2, [[0, 2, 4], [1, 3]]), (2, 4, [[0], [1]]), (3, 1, [[0, 1, 2]]), (0, 3, [])],
)
def test_split_minibatches(n, k, expected):
    assert split_minibatches(n, k) == expected


def test_split_minibatches_needs_one():
    with pytest.raises(ValueError, match="num_minibatches"):
        split_minibatches(4, 0)


# --------------------------------------------------------------------------- top-p, clamps, truncation


def test_nucleus_logprobs_match_the_decoders_and_give_weight_one_at_a_known_kept_mass():
    from grpo_flyte.engine.sampling import Sampling, choose_tokens

    # p = 0.1, 0.2, 0.7 and top_p 0.8: the nucleus is {2, 1}, kept mass 0.9
    logits = torch.tensor([[0.1, 0.2, 0.7]] * 4).log()
    tokens, sampled = choose_tokens(logits, Sampling(1.0, 0.8, 1), torch.tensor([0.5, 0.77, 0.79, 0.99], dtype=torch.float64))
    assert tokens.tolist() == [2, 2, 1, 1]
    logits.requires_grad_(True)
    trained, _ = token_logprobs_and_entropy(logits, tokens, temperature=1.0, top_p=0.8)
    assert trained.tolist() == pytest.approx([math.log(0.7 / 0.9)] * 2 + [math.log(0.2 / 0.9)] * 2, abs=1e-6)
    _, rho = importance_weights(trained, sampled, torch.arange(4), cap=2.0)
    assert rho.tolist() == pytest.approx([1.0] * 4, abs=1e-6)
    # the full-distribution log-prob the trainer used before: every weight off by the kept mass
    full = token_logprobs(logits, tokens, 1.0)
    assert importance_weights(full, sampled, torch.arange(4), cap=2.0)[1].tolist() == pytest.approx([0.9] * 4, abs=1e-6)
    # differentiable through the kept mass; a token outside the nucleus is counted in, never -inf
    trained.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    outside, _ = token_logprobs_and_entropy(logits.detach(), torch.tensor([0, 0, 0, 0]), 1.0, top_p=0.8)
    assert outside.tolist() == pytest.approx([math.log(0.1)] * 4, abs=1e-6)  # {2, 1} plus the target 0: all the mass


def test_training_rewards_reject_a_bad_policy_and_mismatched_lengths():
    from grpo_flyte.learning.grpo import training_rewards

    with pytest.raises(ValueError, match="'min_reward', 'mask' or 'keep'"):
        training_rewards([1.0], [True], "zero")
    with pytest.raises(ValueError, match="2 rewards for 1"):
        training_rewards([1.0, 0.0], [True], "keep")
    assert training_rewards([-1.0, -2.0, 3.0], [False, False, True], "min_reward") == [-1.0, -2.0, -2.0]


# --------------------------------------------------------------------------- learning-rate schedule


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # 10 steps, warmup ceil(0.2 * 10) = 2: 0, lr/2, then the schedule over the 8 steps after it
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.0, 0.5, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8]),
        ("cosine", [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]),
    ],
)
def test_scheduled_lr_hand_computed(schedule, expected):
    got = [grpo.scheduled_lr(step, 10, 1.0, schedule, 0.2) for step in range(10)]
    assert got == pytest.approx(expected)


def test_scheduled_lr_without_warmup_or_total():
    assert grpo.scheduled_lr(0, 4, 2e-4, "linear", 0.0) == pytest.approx(2e-4)  # no warmup: full rate at step 0
    assert grpo.scheduled_lr(3, 0, 2e-4, "cosine", 0.5) == 2e-4  # total unknown: the base rate
    assert grpo.scheduled_lr(12, 10, 1.0, "linear", 0.0) == 0.0  # past the end (a run extended): never negative


def test_rank_share_deals_the_longest_first_round_robin():
    lengths = [3, 9, 5, 7, 1]  # longest first: positions 1 (9), 3 (7), 2 (5), 0 (3), 4 (1)
    assert grpo.rank_share(lengths, 0, 2) == [1, 2, 4]
    assert grpo.rank_share(lengths, 1, 2) == [0, 3]
    assert grpo.rank_share(lengths, 0, 1) == [0, 1, 2, 3, 4]
    assert grpo.rank_share([4], 1, 2) == []  # a rank may get nothing; it still joins the all-reduce
    with pytest.raises(ValueError, match="rank 2 of a world of 2"):
        grpo.rank_share(lengths, 2, 2)
