"""Unit tests for the GRPO objective in grpo_flyte.learning.losses (CPU torch, hand-computed
expectations). The same numbers against TRL's own code: test_losses_trl_parity.py."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_flyte.config.training import TrainConfig
from grpo_flyte.learning import losses
from grpo_flyte.learning.grpo import TrainSequence, pad_batch, plan_micro_batches, token_logprobs
from grpo_flyte.learning.losses import (
    EntropyControl,
    LossNormalizer,
    aggregate_loss,
    effective_sample_size,
    importance_weights,
    kl_k3,
)


def grpo_token_loss(logp, old, adv, epsilon, epsilon_high, weights=None, kl=None, beta=0.0):
    """`losses.token_loss` of loss type grpo, token level, one token per row, no KL bias correction:
    (loss, clipped)."""
    train = TrainConfig(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, use_bias_correction_kl=False)
    n = len(logp)
    out = losses.token_loss(logp, old, adv, torch.arange(n), torch.ones(n, dtype=torch.long), train, weights, kl)
    return out.loss, out.clipped


# --------------------------------------------------------------------------- grpo_token_loss


def test_clipped_token_loss_hand_computed_values_gradients_and_clip_mask():
    # ratios r = exp(logp - old) = [0.5, 0.5, 1.5, 1.5, 1.25]; A = [+1, -1, +1, -1, +1];
    # epsilon = 0.2 -> lower bound 0.8, epsilon_high = 0.3 -> upper bound 1.3
    ratios = torch.tensor([0.5, 0.5, 1.5, 1.5, 1.25])
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7])
    logp = (old + ratios.log()).clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    loss, clipped = grpo_token_loss(logp, old, adv, epsilon=0.2, epsilon_high=0.3)
    # token 0: min(0.5*1, 0.8*1) = 0.5      -> loss -0.5, unclipped (the lower clip binds only for A < 0)
    # token 1: min(-0.5, -0.8)   = -0.8     -> loss +0.8, clipped
    # token 2: min(1.5, 1.3)     = 1.3      -> loss -1.3, clipped
    # token 3: min(-1.5, -1.3)   = -1.5     -> loss +1.5, unclipped
    # token 4: 1.25 is inside [0.8, 1.3]    -> loss -1.25, unclipped
    assert loss.tolist() == pytest.approx([-0.5, 0.8, -1.3, 1.5, -1.25], abs=1e-6)
    assert clipped.tolist() == [False, True, True, False, False]
    loss.sum().backward()
    # d(-r*A)/dlogp = -A*r where unclipped, 0 where the clipped (constant) branch wins
    assert logp.grad.tolist() == pytest.approx([-0.5, 0.0, 0.0, 1.5, -1.25], abs=1e-6)


def test_token_loss_with_ratio_one_is_the_policy_gradient():
    # old = logp (detached): r = 1, value -A, gradient -A (REINFORCE with a baseline)
    logp = torch.tensor([-0.3, -2.0], requires_grad=True)
    loss, clipped = grpo_token_loss(logp, logp.detach(), torch.tensor([2.0, -0.5]), 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-2.0, 0.5])
    assert not clipped.any()
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.5])


def test_token_loss_importance_weights_and_kl_term():
    logp = torch.tensor([math.log(0.5), math.log(0.2)], requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    kl = kl_k3(logp, ref)
    # kl_0 = exp(ref - logp) - (ref - logp) - 1 = 0.5 - ln(0.5) - 1 = ln 2 - 0.5; kl_1 = 0 (same prob)
    assert kl.tolist() == pytest.approx([math.log(2) - 0.5, 0.0], abs=1e-6)
    weights = torch.tensor([2.0, 0.5])
    loss, _ = grpo_token_loss(logp, logp.detach(), torch.tensor([1.0, 1.0]), 0.2, 0.2, weights, kl, beta=0.1)
    # -w * (r * A) + beta * kl with r = 1: [-2 + 0.1 (ln 2 - 0.5), -0.5 + 0]
    assert loss.tolist() == pytest.approx([-2.0 + 0.1 * (math.log(2) - 0.5), -0.5], abs=1e-6)
    loss.sum().backward()
    # d/dlogp: -w*A*r + beta * (1 - exp(ref - logp)) = [-2 + 0.1 * (1 - 0.5), -0.5 + 0]
    assert logp.grad.tolist() == pytest.approx([-2.0 + 0.05, -0.5], abs=1e-6)


def test_token_loss_beta_without_kl_is_an_error():
    logp = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="KL"):
        grpo_token_loss(logp, logp, torch.tensor([1.0]), 0.2, 0.2, beta=0.5)


def test_kl_k3_is_zero_for_equal_policies_and_positive_otherwise():
    a = torch.tensor([-0.1, -3.0, -7.5])
    assert kl_k3(a, a).tolist() == [0.0, 0.0, 0.0]
    assert (kl_k3(a, a + torch.tensor([0.3, -0.2, 1.0])) > 0).all()


def test_token_truncate_weights_cap_and_raw_ratio():
    old = torch.tensor([math.log(0.3), math.log(0.1), math.log(0.4)])
    samp = torch.tensor([math.log(0.1), math.log(0.2), math.log(0.4)])
    weights, rho = importance_weights(old, samp, torch.zeros(3, dtype=torch.long), cap=2.0)
    # rho = p_trainer / p_generator = [3, 0.5, 1]; the weight is capped at 2
    assert rho.tolist() == pytest.approx([3.0, 0.5, 1.0], rel=1e-6)
    assert weights.tolist() == pytest.approx([2.0, 0.5, 1.0], rel=1e-6)
    assert not weights.requires_grad


def test_importance_weights_reject_a_cap_below_one_and_an_unknown_mode():
    with pytest.raises(ValueError, match="cap"):
        importance_weights(torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long), cap=0.5)
    with pytest.raises(ValueError, match="'tokens_truncate': expected one of token_truncate, token_mask"):
        importance_weights(torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long), cap=2.0, mode="tokens_truncate")


def test_importance_weights_per_token_and_per_sequence_truncated_or_masked():
    # two rollouts: tokens 0-1 of rollout 0 with ratios 3 and 0.5, token 2 of rollout 1 with ratio 1.5
    old = torch.tensor([math.log(0.3), math.log(0.1), math.log(0.6)])
    samp = torch.tensor([math.log(0.1), math.log(0.2), math.log(0.4)])
    rows = torch.tensor([0, 0, 1])
    by_mode = {
        mode: importance_weights(old, samp, rows, cap=2.0, mode=mode)
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    }
    assert by_mode["token_mask"][0].tolist() == pytest.approx([0.0, 0.5, 1.5], rel=1e-6)
    # per rollout: 3 * 0.5 = 1.5 for both tokens of rollout 0, 1.5 for rollout 1; none above the cap
    for mode in ("sequence_truncate", "sequence_mask"):
        weights, rho = by_mode[mode]
        assert rho.tolist() == pytest.approx([1.5, 1.5, 1.5], rel=1e-6) and weights.tolist() == pytest.approx([1.5] * 3, rel=1e-6)
    # a cap of 1.2: the whole rollout is cut to the cap, or to 0
    assert importance_weights(old, samp, rows, cap=1.2, mode="sequence_truncate")[0].tolist() == pytest.approx([1.2] * 3, rel=1e-6)
    assert importance_weights(old, samp, rows, cap=1.2, mode="sequence_mask")[0].tolist() == [0.0, 0.0, 0.0]


def test_effective_sample_size_hand_computed():
    # weights [2, 0.5, 1]: (3.5)^2 / (3 * (4 + 0.25 + 1)) = 12.25 / 15.75
    assert effective_sample_size(3.5, 5.25, 3) == pytest.approx(12.25 / 15.75)
    assert effective_sample_size(4.0, 4.0, 4) == 1.0  # all equal
    assert effective_sample_size(0.0, 0.0, 3) == 0.0  # all masked
    assert effective_sample_size(0.0, 0.0, 0) == 1.0  # no tokens: nothing to correct


# --------------------------------------------------------------------------- aggregate_loss

# token losses [1, 2, 3 | 4, 5]: sequence 0 has 3 tokens, sequence 1 has 2; S = 2, T = 5, L = 4
_TOKEN_LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
_ROWS = torch.tensor([0, 0, 0, 1, 1])
_LENGTHS = torch.tensor([3, 2])
_NORM = LossNormalizer(num_sequences=2, num_tokens=5, max_completion_tokens=4)


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        ("grpo", 0.5 * ((1 + 2 + 3) / 3 + (4 + 5) / 2)),  # (1/2)(2 + 4.5) = 3.25
        ("dr_grpo", 15 / (2 * 4)),  # 1.875
        ("dapo", 15 / 5),  # 3.0
    ],
)
def test_aggregate_loss_hand_computed(loss_type, expected):
    value = aggregate_loss(_TOKEN_LOSS, _ROWS, _LENGTHS, loss_type, _NORM)
    assert value.item() == pytest.approx(expected)


def test_aggregate_loss_variants_weight_long_and_short_completions_differently():
    # The gradient each token gets: grpo 1/(S|o_i|), dr_grpo 1/(S L), dapo 1/T.
    grads = {}
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        x = _TOKEN_LOSS.clone().requires_grad_(True)
        aggregate_loss(x, _ROWS, _LENGTHS, loss_type, _NORM).backward()
        grads[loss_type] = x.grad.tolist()
    assert grads["grpo"] == pytest.approx([1 / 6] * 3 + [1 / 4] * 2)
    assert grads["dr_grpo"] == pytest.approx([1 / 8] * 5)
    assert grads["dapo"] == pytest.approx([1 / 5] * 5)


def test_aggregate_loss_unknown_type():
    with pytest.raises(ValueError, match="'ppo'"):
        aggregate_loss(_TOKEN_LOSS, _ROWS, _LENGTHS, "ppo", _NORM)


# --------------------------------------------------------------------------- micro-batching


def _loss_for(seqs, logits_by_seq, old_by_seq, pad_id, norm, temperature, loss_type):
    """Pad `seqs`, gather per-token log-probs from the given per-sequence logits, return the loss."""
    batch = pad_batch(seqs, pad_id)
    width = batch.input_ids.shape[1]
    vocab = logits_by_seq[0].shape[-1]
    logits = torch.zeros(len(seqs), width, vocab)
    for b, lg in enumerate(logits_by_seq):
        logits[b, : lg.shape[0]] = lg
    lp = token_logprobs(logits[batch.predict_mask], batch.targets[batch.predict_mask], temperature)
    old = torch.cat(old_by_seq)
    adv = torch.tensor([s.advantage for s in seqs])[batch.row_of_token]
    lengths = torch.tensor([len(s.completion_ids) for s in seqs])
    token_loss, _ = grpo_token_loss(lp, old, adv, 0.2, 0.3)
    return aggregate_loss(token_loss, batch.row_of_token, lengths, loss_type, norm)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batch_losses_sum_to_full_batch_loss(loss_type):
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    seqs = [
        TrainSequence(prompt_ids=[1, 2, 3], completion_ids=[4, 5, 0], advantage=1.5),
        TrainSequence(prompt_ids=[6], completion_ids=[7, 0], advantage=-0.5),
        TrainSequence(prompt_ids=[8, 9], completion_ids=[10, 3, 3, 0], advantage=0.25),
        TrainSequence(prompt_ids=[2, 2, 2, 2], completion_ids=[0], advantage=-1.25),
    ]
    # each sequence's logits depend only on the sequence (as a causal LM's would), not on padding
    logits_by_seq = [torch.randn(s.length, vocab, generator=gen) for s in seqs]
    old_by_seq = [torch.randn(len(s.completion_ids), generator=gen) * 0.2 - 2.0 for s in seqs]
    norm = LossNormalizer(len(seqs), sum(len(s.completion_ids) for s in seqs), max_completion_tokens=6)
    full = _loss_for(seqs, logits_by_seq, old_by_seq, 0, norm, 0.7, loss_type)

    plan = plan_micro_batches([s.length for s in seqs], token_budget=12)
    assert len(plan) > 1  # the point of the test: more than one micro-batch
    split = sum(
        _loss_for([seqs[i] for i in mb], [logits_by_seq[i] for i in mb], [old_by_seq[i] for i in mb], 0, norm, 0.7, loss_type)
        for mb in plan
    )
    assert split.item() == pytest.approx(full.item(), abs=1e-6)

    # and the full loss equals the formula written out per sequence
    per_sequence = []
    for s, lg, old in zip(seqs, logits_by_seq, old_by_seq, strict=False):
        p = len(s.prompt_ids)
        lp = torch.log_softmax(lg / 0.7, dim=-1)
        terms = []
        for t, tok in enumerate(s.completion_ids):
            r = math.exp(lp[p - 1 + t, tok].item() - old[t].item())
            terms.append(-min(r * s.advantage, min(max(r, 0.8), 1.3) * s.advantage))
        per_sequence.append(terms)
    if loss_type == "grpo":
        expected = sum(sum(t) / len(t) for t in per_sequence) / len(seqs)
    elif loss_type == "dr_grpo":
        expected = sum(sum(t) for t in per_sequence) / (len(seqs) * 6)
    else:
        expected = sum(sum(t) for t in per_sequence) / norm.num_tokens
    assert full.item() == pytest.approx(expected, abs=1e-5)


def test_log_ratios_are_clamped_so_nothing_overflows():
    logprobs = torch.tensor([-0.1, -200.0], requires_grad=True)
    far = torch.tensor([-150.0, -0.1])  # log-ratios of +149.9 and -199.9
    loss, _ = grpo_token_loss(logprobs, far, torch.tensor([1.0, -1.0]), 0.2, 0.2)
    assert torch.isfinite(loss).all()
    _, rho = importance_weights(far, torch.tensor([-1000.0, 0.0]), torch.arange(2), cap=2.0)
    assert rho.tolist() == pytest.approx([math.exp(20.0), math.exp(-0.1)], rel=1e-5)  # exp(850) clamped to exp(20)
    kl = kl_k3(logprobs.detach(), torch.tensor([-900.0, -0.1]))
    assert torch.isfinite(kl).all() and kl[1].item() == pytest.approx(math.exp(20.0) - 21.0, rel=1e-5)


# --------------------------------------------------------------------------- the new loss types, by hand


def _one_row(logp, old, adv, level="token", **settings):
    """token_loss over one rollout of len(logp) tokens with advantage `adv` (A on every token)."""
    n = len(logp)
    train = TrainConfig(importance_sampling_level=level, **settings)
    return losses.token_loss(logp, old, torch.full((n,), adv), torch.zeros(n, dtype=torch.long), torch.tensor([n]), train)


def test_gspo_ratio_is_the_exp_of_the_mean_log_ratio_on_every_token():
    # log-ratios 0.2 and -0.1: the sequence ratio is exp(0.05) on both tokens
    old = torch.tensor([-1.0, -2.0])
    logp = (old + torch.tensor([0.2, -0.1])).requires_grad_(True)
    r = math.exp(0.05)
    assert losses.log_ratios(logp, old, torch.tensor([0, 0]), torch.tensor([2]), "sequence").tolist() == pytest.approx([0.05, 0.05])
    out = _one_row(logp, old, 1.0, "sequence", epsilon=0.2, epsilon_high=0.2)
    assert out.loss.tolist() == pytest.approx([-r, -r], abs=1e-6)
    out.loss.sum().backward()
    # d/dlogp_t of -2r with r = exp((l_0 + l_1)/2): -2 r / 2 = -r on each token
    assert logp.grad.tolist() == pytest.approx([-r, -r], abs=1e-6)
    with pytest.raises(ValueError, match="'token' or 'sequence'"):
        losses.log_ratios(logp, old, torch.tensor([0, 0]), torch.tensor([2]), "tokens")


def test_sapo_gate_on_two_tokens():
    # r = 1 and r = 2 with A = +1 (tau_pos = 1): p_t = -4 sigmoid(r - 1); gradient -4 s (1 - s) r
    old = torch.tensor([-1.0, -1.0])
    logp = (old + torch.tensor([0.0, math.log(2.0)])).requires_grad_(True)
    out = _one_row(logp, old, 1.0, loss_type="sapo")
    s1 = 1 / (1 + math.exp(-1.0))
    assert out.loss.tolist() == pytest.approx([-2.0, -4 * s1], abs=1e-6)
    out.loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -4 * s1 * (1 - s1) * 2.0], abs=1e-6)
    # A = -1 uses tau_neg = 1.05: p_t = (4 / 1.05) sigmoid(1.05 (r - 1)) at r = 1: 2 / 1.05
    negative = _one_row(old.clone(), old, -1.0, loss_type="sapo")
    assert negative.loss.tolist() == pytest.approx([2 / 1.05, 2 / 1.05], abs=1e-6)


def test_cispo_weight_is_the_capped_ratio_without_gradient():
    # r = 3 capped at epsilon_high 2: p = -2 * A * logp, gradient -2 A; the token counts as clipped
    old = torch.tensor([-1.0, -1.0])
    logp = (old + torch.tensor([math.log(3.0), 0.0])).requires_grad_(True)
    out = _one_row(logp, old, 0.5, loss_type="cispo", epsilon_high=2.0)
    assert out.loss.tolist() == pytest.approx([-2.0 * 0.5 * logp[0].item(), -1.0 * 0.5 * -1.0], abs=1e-6)
    assert out.clipped.tolist() == [True, False]
    out.loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -0.5], abs=1e-6)


def test_vespo_phi_is_one_at_ratio_one_and_below_one_elsewhere():
    train = TrainConfig(loss_type="vespo")
    rows, lengths = torch.tensor([0, 0, 1]), torch.tensor([2, 1])
    at_one = losses.vespo_weights(torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]), rows, lengths, None, train)
    assert at_one.tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    # rollout 0: log w = 0.3 + 0.4 = 0.7, A >= 0 (k 2, lambda 3): phi = exp(3 + 2 * 0.7 - 3 e^0.7)
    w = losses.vespo_weights(torch.tensor([0.3, 0.4, 0.0]), torch.tensor([1.0, 1.0, -1.0]), rows, lengths, None, train)
    assert w[0].item() == pytest.approx(math.exp(3 + 1.4 - 3 * math.exp(0.7)), rel=1e-5) and w[0] < 1
    # an importance weight of 0.5 on rollout 1 (A < 0: k 3, lambda 2): log w = ln 0.5
    weights = torch.tensor([1.0, 1.0, 0.5])
    w = losses.vespo_weights(torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]), rows, lengths, weights, train)
    assert w[2].item() == pytest.approx(math.exp(2 + 3 * math.log(0.5) - 2 * 0.5), rel=1e-5)


def test_delta_caps_the_unclipped_ratio_of_a_negative_advantage():
    # r = 3, A = -1: without delta the loss is -min(-3, -1.2) = 3; with delta 2 it is 2
    old = torch.tensor([-1.0])
    logp = old + math.log(3.0)
    assert _one_row(logp, old, -1.0).loss.item() == pytest.approx(3.0, rel=1e-6)
    assert _one_row(logp, old, -1.0, delta=2.0).loss.item() == pytest.approx(2.0, rel=1e-6)


def test_kl_bias_correction_multiplies_the_kl_by_the_ratio():
    # A = 0: only the KL term, 0.5 * 0.2, times r = 1.5 with the correction
    old = torch.tensor([-1.0])
    logp = old + math.log(1.5)
    kl = torch.tensor([0.2])

    def kl_term(correct: bool) -> float:
        train = TrainConfig(beta=0.5, use_bias_correction_kl=correct)
        return losses.token_loss(logp, old, torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.tensor([1]), train, kl=kl).loss.item()

    assert kl_term(False) == pytest.approx(0.5 * 0.2, rel=1e-6)
    assert kl_term(True) == pytest.approx(0.5 * 0.2 * 1.5, rel=1e-6)


def test_off_policy_mask_drops_only_drifted_negative_rollouts():
    # rollout 0 (A < 0): mean(samp - logp) = (0.6 + 0.2) / 2 = 0.4 > 0.3: dropped; rollout 1 (A > 0)
    # drifted as far: kept; rollout 2 (A < 0) drifted 0.1: kept
    rows, lengths = torch.tensor([0, 0, 1, 2]), torch.tensor([2, 1, 1])
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    samp = torch.tensor([-0.4, -0.8, -0.2, -0.9])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    assert losses.off_policy_mask(adv, logp, samp, rows, lengths, 0.3).tolist() == [False, False, True, True]


def test_entropy_threshold_keeps_the_top_quantile():
    entropies = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.7])
    # the 0.6 quantile of 5 values (linear): position 0.6 * 4 = 2.4 between 0.5 and 0.7: 0.58
    tau = losses.entropy_threshold(entropies, 0.4)
    assert tau.item() == pytest.approx(0.58, abs=1e-6)
    assert (entropies >= tau).tolist() == [False, False, False, True, True]
    assert losses.entropy_threshold(entropies, 0.0).item() == pytest.approx(0.9)  # only the highest
    assert (entropies >= losses.entropy_threshold(entropies, 1.0)).all()


def test_importance_weights_lower_bound_truncates_or_masks():
    old, samp, rows = torch.log(torch.tensor([0.1, 0.3])), torch.log(torch.tensor([0.4, 0.3])), torch.arange(2)
    # rho = [0.25, 1]; clip_min 0.5
    assert importance_weights(old, samp, rows, 2.0, "token_truncate", 0.5)[0].tolist() == pytest.approx([0.5, 1.0])
    assert importance_weights(old, samp, rows, 2.0, "token_mask", 0.5)[0].tolist() == pytest.approx([0.0, 1.0])
    with pytest.raises(ValueError, match="lower bound"):
        importance_weights(old, samp, rows, 2.0, "token_mask", 2.0)


def test_aggregate_loss_of_the_new_types():
    # token losses [1, 2, 3 | 4, 5]: luspo sums each sequence, then means: (6 + 9) / 2; sapo is
    # grpo's per-sequence mean; bnpo, cispo and vespo are dapo's token mean
    assert aggregate_loss(_TOKEN_LOSS, _ROWS, _LENGTHS, "luspo", _NORM).item() == pytest.approx(7.5)
    assert aggregate_loss(_TOKEN_LOSS, _ROWS, _LENGTHS, "sapo", _NORM).item() == pytest.approx(3.25)
    for loss_type in ("bnpo", "cispo", "vespo"):
        assert aggregate_loss(_TOKEN_LOSS, _ROWS, _LENGTHS, loss_type, _NORM).item() == pytest.approx(3.0)


def test_entropy_bonus_is_minus_coef_times_the_mean_over_kept_tokens():
    h = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    norm = LossNormalizer(1, 3, 4, num_entropy_tokens=2)
    bonus = losses.entropy_bonus(h, torch.tensor([True, False, True]), 0.1, norm)
    assert bonus.item() == pytest.approx(-0.1 * (1 + 3) / 2)
    bonus.backward()
    assert h.grad.tolist() == pytest.approx([-0.05, 0.0, -0.05])


def test_adaptive_entropy_control_steps_within_bounds_and_gates_on_the_last_entropy():
    train = TrainConfig(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.005, entropy_target=1.0, entropy_coef_max=0.012)
    start = EntropyControl(0.01)
    assert start.applied(train) == 0.0  # nothing measured yet (TRL: inf)
    low = start.updated(0.5, train)  # at or below the target: up, capped at the max
    assert (low.coef, low.last_entropy, low.applied(train)) == (pytest.approx(0.012), 0.5, pytest.approx(0.012))
    high = low.updated(1.5, train)  # above: down, and not applied
    assert (high.coef, high.applied(train)) == (pytest.approx(0.007), 0.0)
    assert EntropyControl(0.003).updated(2.0, train).coef == 0.0  # floored at entropy_coef_min
    assert EntropyControl(0.3).applied(TrainConfig(entropy_coef=0.3)) == 0.3  # static: always applied


# --------------------------------------------------------------------------- on the first pass


def _first_pass_gradient(logp: torch.Tensor, second_pass: bool, **settings) -> torch.Tensor:
    """The gradient of one minibatch's loss (`token_loss` then `aggregate_loss`) with respect to
    the log-probs, on the first pass (old = the current policy, detached: every ratio 1) or, with
    `second_pass`, against an old policy the update has moved from."""
    train = TrainConfig(**settings)
    rows, lengths = torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([3, 2, 1])
    advantages = torch.tensor([1.2, -0.7, 0.4])[rows]
    x = logp.clone().requires_grad_(True)
    old = x.detach() - (torch.tensor([0.3, -0.2, 0.5, -0.4, 0.1, 0.25]) if second_pass else 0.0)
    out = losses.token_loss(x, old, advantages, rows, lengths, train)
    norm = LossNormalizer(num_sequences=3, num_tokens=6, max_completion_tokens=4)
    aggregate_loss(out.loss, rows, lengths, train.loss_type, norm).backward()
    return x.grad


@pytest.mark.parametrize(
    ("variant", "same_as", "parts_later"),
    [
        ({"loss_type": "sapo"}, {"loss_type": "grpo"}, True),  # the gate's slope at r = 1 is 1
        ({"importance_sampling_level": "sequence"}, {}, True),  # GSPO: the sequence ratio's slope is 1/|o_i| a token
        ({"loss_type": "vespo"}, {"loss_type": "dapo"}, True),  # phi(1) = 1
        ({"loss_type": "cispo", "epsilon_high": 5.0}, {"loss_type": "dapo"}, True),  # sg(min(1, 5)) A logp
        ({"loss_type": "bnpo"}, {"loss_type": "dapo"}, False),  # one process: the same aggregation, at every pass
    ],
)
def test_on_the_first_pass_these_objectives_give_the_same_update(variant, same_as, parts_later):
    """With num_iterations 1 and one update an iteration (the default), every ratio is 1 and these
    objectives take the same gradient as the one beside them, so a recipe-sweep cell of one
    measures the other (docs/measurements.md, issue 51). From the second pass on (mu = 2) all but
    bnpo part from it."""
    logp = torch.tensor([-0.5, -1.5, -0.9, -2.0, -0.3, -1.1])
    first = _first_pass_gradient(logp, False, **variant), _first_pass_gradient(logp, False, **same_as)
    assert torch.allclose(*first, atol=1e-6) and first[0].abs().sum() > 0
    later = _first_pass_gradient(logp, True, **variant), _first_pass_gradient(logp, True, **same_as)
    assert torch.allclose(*later, atol=1e-4) != parts_later
