"""This module holds the GRPO objective: the per-token loss of each loss type and its aggregation,
the ratios it is made of, the importance weights, the KL, the token masks and the entropy bonus.

Pure functions on flat tensors, one formula each, written once in the docstring of the function
that computes it; torch is imported inside them. Each mirrors TRL 1.16's `GRPOTrainer._compute_loss`
(tests/unit/learning/test_losses_trl_parity.py feeds both the same numbers).

Notation (as in grpo_flyte.learning.grpo), per trained token t of rollout i:
    logp, old, samp, ref   the trainer's log-prob now, at the start of the iteration, the
                           generator's, the reference policy's
    A_i                    the rollout's advantage; |o_i| its trained tokens
    rows                   (N,) the rollout (row of the micro-batch) of each token
    lengths                (B,) |o_i| per row

Tokens are one flat (N,) vector per micro-batch, where TRL has (B, T) padded tensors and a mask:
a per-rollout quantity (TRL's (B, 1)) is the same value on each of the rollout's tokens here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo_flyte.config.training import TrainConfig

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp (as verl does), so that a stray token
# whose log-probs disagree by hundreds cannot overflow the ratio to inf.
LOG_RATIO_CLAMP = 20.0

# TRL's vllm_importance_sampling_mode values: the level the ratio is taken at, and what a weight outside the bounds becomes.
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# The loss types whose surrogate is PPO's clipped one (they differ in `aggregate_loss` only).
CLIPPED = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")
LOSS_TYPES = (*CLIPPED, "cispo", "sapo", "vespo")

# VESPO's floor on its sequence log-weight, log(1e-8) (TRL's `get_gamma_weights`, after the paper's code).
VESPO_LOG_FLOOR = math.log(1e-8)


def row_means(values: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """m_t = (1/|o_i|) * sum over the tokens t' of t's rollout i of values_t': the rollout's mean,
    on each of its tokens: (N,), (N,), (B,) -> (N,). Differentiable."""
    import torch

    sums = torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, rows, values)
    return (sums / lengths.to(values.dtype).clamp(min=1.0))[rows]


def log_ratios(logprobs: torch.Tensor, old_logprobs: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, level: str) -> torch.Tensor:
    """The log of the policy ratio each token's surrogate uses: (N,).

        token:     log r_t = logp_t - old_t
        sequence:  log r_t = (1/|o_i|) * sum over t' in o_i of (logp_t' - old_t')    (GSPO; every token of o_i)

    clamped to +-LOG_RATIO_CLAMP. `old_logprobs` is detached; at sequence level the gradient of
    r_t reaches every token of the rollout.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r}: expected 'token' or 'sequence'")
    log_ratio = logprobs - old_logprobs.detach()
    if level == "sequence":
        log_ratio = row_means(log_ratio, rows, lengths)
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    rows: torch.Tensor,
    cap: float,
    mode: str = "token_truncate",
    clip_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights for the generator/trainer mismatch, one per token: (weights, raw ratios).

        token level:     rho_t = exp(old_t - samp_t)
        sequence level:  rho_t = exp(sum over the tokens t' of t's rollout of (old_t' - samp_t'))
        truncate:        w_t = clip(rho_t, clip_min, cap)
        mask:            w_t = rho_t if clip_min <= rho_t <= cap, else 0

    (clip_min None: no lower bound.) The generator (vLLM, batched KV-cached decoding, an older
    adapter in a pipelined run) and the trainer (a full forward pass of the current adapter) give
    different log-probs for the same token; w_t re-weights each token's surrogate towards the
    trainer's policy, and the bounds limit the variance. `rows[t]` is token t's rollout (0-based,
    within this batch). Both are detached.
    """
    import torch

    if cap < 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    if clip_min is not None and not 0.0 <= clip_min < cap:
        raise ValueError(f"the importance-weight lower bound {clip_min}: expected 0 <= clip_min < cap ({cap})")
    if mode not in IS_MODES:
        raise ValueError(f"importance-sampling mode {mode!r}: expected one of {', '.join(IS_MODES)}")
    log_rho = old_logprobs.detach().float() - sampling_logprobs.float()
    if mode.startswith("sequence"):
        per_row = torch.zeros(int(rows.max()) + 1 if rows.numel() else 0, device=log_rho.device).index_add(0, rows, log_rho)
        log_rho = per_row[rows]
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode.endswith("truncate"):
        return torch.clamp(rho, min=clip_min, max=cap), rho
    inside = (rho <= cap) if clip_min is None else (rho <= cap) & (rho >= clip_min)
    return torch.where(inside, rho, torch.zeros_like(rho)), rho


def effective_sample_size(weight_sum: float, weight_square_sum: float, count: int) -> float:
    """The effective sample size of `count` importance weights as a fraction of `count`:
    (sum w)^2 / (count * sum w^2); 1 when all are equal, towards 1/count when one dominates,
    0 when all are 0."""
    if count == 0:
        return 1.0
    return weight_sum**2 / (count * weight_square_sum) if weight_square_sum > 0 else 0.0


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, the non-negative "k3" estimator:

        kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

    Unbiased for KL(pi || pi_ref) when the tokens are sampled from pi, and 0 where they agree.
    The log-ratio is clamped to +-LOG_RATIO_CLAMP.
    """
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return delta.exp() - delta - 1.0


def off_policy_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `get_off_policy_mask`): which tokens stay, (N,) bool.

        keep_i = A_i >= 0  or  (1/|o_i|) * sum over t in o_i of (samp_t - logp_t) <= threshold

    A rollout with a negative advantage whose sampling policy has drifted from the current one by
    more than `threshold` (mean per-token log-ratio) is dropped. `behaviour_logprobs` are the
    sampling log-probs (the old ones when the generator gave none); nothing here has a gradient.
    """
    drift = row_means((behaviour_logprobs - logprobs.detach()).nan_to_num(nan=0.0), rows, lengths)
    return (advantages >= 0) | (drift <= threshold)


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy above which a token stays in the policy loss (TRL's `get_high_entropy_mask`):

        tau = the (1 - quantile) quantile of the entropies (linear interpolation);  keep_t = H_t >= tau

    so that about the `quantile` share of highest-entropy tokens stays ("Beyond the 80/20 Rule");
    quantile 0 keeps the highest only. `entropies`: every token of the population (N,), float32.
    """
    import torch

    if entropies.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(entropies.detach().float(), 1.0 - quantile)


def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    is_weights: torch.Tensor | None,
    train: TrainConfig,
) -> torch.Tensor:
    """VESPO's gamma weight of each token's rollout, phi(w_i) (detached): (N,).

        log w_i = clamp(sum over t in o_i of (clamp(logp_t - old_t, -20, 20) + log w_is_t), log 1e-8, 20)
        phi(w)  = e^lambda * w^k * e^(-lambda w)        phi(1) = 1
        k, lambda = vespo_k_pos, vespo_lambda_pos if A_i >= 0, else vespo_k_neg, vespo_lambda_neg (lambda >= 1e-4)

    `log_ratio`: the token log-ratios logp_t - old_t; `is_weights`: the generator/trainer
    importance weights w_is_t (token level; None: none), each floored at 1e-8 in log space.
    """
    import torch

    with torch.no_grad():
        log_w = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if is_weights is not None:
            log_w = log_w + torch.log(is_weights).clamp(VESPO_LOG_FLOOR, LOG_RATIO_CLAMP)
        sums = torch.zeros(len(lengths), dtype=log_w.dtype, device=log_w.device).index_add(0, rows, log_w)
        log_w = sums[rows].clamp(VESPO_LOG_FLOOR, LOG_RATIO_CLAMP)
        positive = advantages >= 0
        k = torch.where(positive, train.vespo_k_pos, train.vespo_k_neg)
        lam = torch.where(positive, train.vespo_lambda_pos, train.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass
class TokenLoss:
    """`token_loss`'s result: the loss per token (N,), which tokens were clipped (N,) bool (the
    loss type's own sense; all False for sapo and vespo), and vespo's phi (N,) (None otherwise)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    phi: torch.Tensor | None = None


def token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    train: TrainConfig,
    is_weights: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> TokenLoss:
    """The per-token loss of `train.loss_type`, r_t = exp(log r_t) (`log_ratios`, token or sequence level):

        grpo, dr_grpo, dapo, bnpo, luspo:  p_t = -min(min(r_t, delta) * A, clip(r_t, 1 - epsilon, 1 + epsilon_high) * A)
        cispo:                             p_t = -sg(min(r_t, epsilon_high)) * A * logp_t
        sapo:                              p_t = -(4 / tau) * sigmoid(tau * (r_t - 1)) * A,  tau = sapo_temperature_pos if A > 0 else _neg
        vespo:                             p_t = -sg(phi(w_i)) * A * logp_t   (`vespo_weights`)

        loss_t = p_t * keep_t * w_t + beta * kl_t * (r_t if use_bias_correction_kl else 1)

    sg: no gradient; min(r, delta) only with delta set. `advantages` (N,) holds each token's
    rollout advantage, w_t the importance weights (1 when None; vespo has them inside phi
    instead), keep_t the masks (off-policy, high-entropy; 1 when None), kl_t the per-token KL
    (`kl_k3`; required when beta > 0). clipped: for the clipped types r_t < 1 - epsilon with A < 0
    or r_t > 1 + epsilon_high with A > 0 (after delta); for cispo r_t > epsilon_high with A > 0.
    """
    import torch

    kind = train.loss_type
    log_ratio = log_ratios(logprobs, old_logprobs, rows, lengths, train.importance_sampling_level)
    ratio = torch.exp(log_ratio)
    phi = None
    no_clip = torch.zeros_like(advantages, dtype=torch.bool)
    if kind in CLIPPED:
        clipped_ratio = torch.clamp(ratio, 1.0 - train.epsilon, 1.0 + train.epsilon_high)
        unclipped = ratio if train.delta is None else torch.clamp(ratio, max=train.delta)
        loss = -torch.minimum(unclipped * advantages, clipped_ratio * advantages)
        with torch.no_grad():
            clipped = ((unclipped < 1.0 - train.epsilon) & (advantages < 0)) | ((unclipped > 1.0 + train.epsilon_high) & (advantages > 0))
    elif kind == "cispo":
        loss = -torch.clamp(ratio, max=train.epsilon_high).detach() * advantages * logprobs
        clipped = ((ratio > train.epsilon_high) & (advantages > 0)).detach()
    elif kind == "sapo":
        tau = torch.where(advantages > 0, train.sapo_temperature_pos, train.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
        clipped = no_clip
    elif kind == "vespo":
        raw = logprobs.detach() - old_logprobs.detach()
        phi = vespo_weights(raw, advantages, rows, lengths, is_weights, train)
        loss = -phi * advantages * logprobs
        clipped = no_clip
    else:
        raise ValueError(f"loss_type={kind!r}: expected one of {', '.join(LOSS_TYPES)}")
    if keep is not None:
        loss = loss * keep.to(loss.dtype)
    if is_weights is not None and kind != "vespo":
        loss = loss * is_weights
    if train.beta != 0.0:
        if kl is None:
            raise ValueError("beta != 0 needs the per-token KL")
        loss = loss + train.beta * (kl * ratio if train.use_bias_correction_kl else kl)
    return TokenLoss(loss, clipped, phi)


@dataclass(frozen=True)
class LossNormalizer:
    """The sizes of one optimizer step's minibatch that `aggregate_loss` and `entropy_bonus` divide by.

    They count every rollout of the minibatch, those left out of the forward pass included (TRL
    normalizes over the whole batch): a step's size does not depend on how many rollouts had a
    nonzero advantage, and dr_grpo's normalizer stays the constant S x L it is meant to be.
    """

    num_sequences: int  # S: rollouts in the minibatch, masked ones included
    num_tokens: int  # T: completion tokens of the minibatch's unmasked rollouts
    max_completion_tokens: int  # L: the completion length limit (max_new_tokens)
    num_entropy_tokens: int = 0  # E: the tokens the entropy bonus averages over (T, or those top_entropy_quantile keeps)


def aggregate_loss(
    token_loss: torch.Tensor,
    row_of_token: torch.Tensor,
    completion_lengths: torch.Tensor,
    loss_type: str,
    norm: LossNormalizer,
) -> torch.Tensor:
    """Reduce per-token losses l_it of one micro-batch to its share of the minibatch loss.

        grpo, sapo:               L = (1/S) * sum_i (1/|o_i|) * sum_t l_it    per-sequence mean, then mean over sequences
        dr_grpo:                  L = 1/(S*L) * sum_i sum_t l_it               sum over tokens / a constant (S x length limit)
        dapo, bnpo, cispo, vespo: L = (1/T) * sum_i sum_t l_it                 token-level mean over the minibatch
        luspo:                    L = (1/S) * sum_i sum_t l_it                 per-sequence sum, mean over sequences

    S, T and L come from `norm` and count the whole minibatch, so summing this over its
    micro-batches gives the minibatch loss. row_of_token: (N,) the row of each token;
    completion_lengths: (B,) |o_i| per row of the micro-batch. (TRL's bnpo divides each device's
    micro-batch by its own tokens; with the whole minibatch as the unit it is dapo.)
    """
    if loss_type in ("grpo", "sapo"):
        per_token = 1.0 / (completion_lengths[row_of_token].to(token_loss.dtype) * norm.num_sequences)
        return (token_loss * per_token).sum()
    if loss_type == "dr_grpo":
        return token_loss.sum() / (norm.num_sequences * norm.max_completion_tokens)
    if loss_type in ("dapo", "bnpo", "cispo", "vespo"):
        return token_loss.sum() / max(1, norm.num_tokens)
    if loss_type == "luspo":
        return token_loss.sum() / norm.num_sequences
    raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")


def entropy_bonus(entropy: torch.Tensor, keep: torch.Tensor | None, coef: float, norm: LossNormalizer) -> torch.Tensor:
    """This micro-batch's share of the entropy term, the objective being L = L_policy - coef * H:

        -coef * (1/E) * sum over the kept tokens t of H_t

    H_t the token's entropy (differentiable), keep_t the high-entropy mask (all tokens when None),
    E = norm.num_entropy_tokens counts the minibatch's kept tokens: H is their mean, whatever the
    loss type's normalizer (TRL's definition).
    """
    kept = entropy if keep is None else entropy * keep.to(entropy.dtype)
    return -coef * kept.sum() / max(1, norm.num_entropy_tokens)


@dataclass(frozen=True)
class EntropyControl:
    """The entropy coefficient of Skywork-OR1's adaptive control (TRL's use_adaptive_entropy) and
    the entropy the last optimizer step measured (None: none yet). Saved in the adapter folder."""

    coef: float
    last_entropy: float | None = None

    def applied(self, train: TrainConfig) -> float:
        """The coefficient the next step applies: `coef`, except in adaptive control while the last
        measured entropy is above entropy_target (or none was measured yet): 0."""
        if not train.use_adaptive_entropy:
            return self.coef
        return self.coef if self.last_entropy is not None and self.last_entropy <= train.entropy_target else 0.0

    def updated(self, entropy: float, train: TrainConfig) -> EntropyControl:
        """After an optimizer step that measured mean entropy H over the bonus's tokens:

        coef' = min(coef + entropy_coef_delta, entropy_coef_max)  if H <= entropy_target
                max(coef - entropy_coef_delta, entropy_coef_min)  otherwise
        """
        if entropy <= train.entropy_target:
            coef = min(self.coef + train.entropy_coef_delta, train.entropy_coef_max)
        else:
            coef = max(self.coef - train.entropy_coef_delta, train.entropy_coef_min)
        return EntropyControl(coef, entropy)


@dataclass
class MicroBatchObjective:
    """`objective`'s result: the loss (a scalar, this micro-batch's share of the minibatch loss)
    and its parts for the metrics; a part not computed is None."""

    loss: torch.Tensor
    terms: TokenLoss
    kl: torch.Tensor | None = None  # (N,) kl_k3, 0 where no reference log-prob was computed
    weights: torch.Tensor | None = None  # (N,) the importance weights w_t (computed even when not applied)
    rho: torch.Tensor | None = None  # (N,) the raw importance ratios
    stays: torch.Tensor | None = None  # (N,) bool: the off-policy mask
    high: torch.Tensor | None = None  # (N,) bool: the high-entropy mask


def objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    train: TrainConfig,
    norm: LossNormalizer,
    sampling_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    threshold: float | None = None,
    coef: float = 0.0,
) -> MicroBatchObjective:
    """One micro-batch's share of the minibatch objective, composed as TRL's `_compute_loss`:

        w_t     = importance_weights(old, samp)        with samp given and is_correction (else none)
        keep_t  = high_t & stays_t                     high_t = H_t >= threshold (threshold given),
                                                       stays_t = off_policy_mask(samp, or old without samp)
        L       = aggregate_loss(token_loss(..., w, kl_k3(logp, ref), keep))
                  + entropy_bonus(H, high, coef)       (with an entropy bonus)

    `ref_logprobs` (N,) may hold NaN where no reference log-prob was computed: kl is 0 there.
    """
    import torch

    kl = None
    if ref_logprobs is not None:
        known = ~torch.isnan(ref_logprobs)
        kl = kl_k3(logprobs, ref_logprobs.nan_to_num(0.0)) * known
    weights = rho = None
    if sampling_logprobs is not None:
        weights, rho = importance_weights(old_logprobs, sampling_logprobs, rows, train.is_cap, train.is_mode, train.is_clip_min)
    high = None if threshold is None else entropy.detach() >= threshold
    keep, stays = high, None
    if train.off_policy_mask_threshold is not None:
        behaviour = sampling_logprobs if sampling_logprobs is not None else old_logprobs
        stays = off_policy_mask(advantages, logprobs, behaviour, rows, lengths, train.off_policy_mask_threshold)
        keep = stays if keep is None else keep & stays
    applied = weights if train.is_correction else None
    terms = token_loss(logprobs, old_logprobs, advantages, rows, lengths, train, applied, kl, keep)
    loss = aggregate_loss(terms.loss, rows, lengths, train.loss_type, norm)
    if train.entropy_bonus:
        loss = loss + entropy_bonus(entropy, high, coef, norm)
    return MicroBatchObjective(loss, terms, kl, weights, rho, stays, high)
