"""The GRPO objective against TRL 1.16's own code: the same log-probs, entropies, advantages and
masks go into grpo_flyte's `losses.objective` (flat tokens) and into TRL's
`GRPOTrainer._compute_loss` (padded (B, T) tensors), called unbound on a stand-in trainer; the loss
and its gradients with respect to the log-probs and the entropies must agree.

Two pieces of TRL cannot be called alone, so their formulas are copied here with the place they
come from: the importance-sampling ratio and the advantages, both computed inside
`GRPOTrainer._generate_and_score_completions` (trl/trainer/grpo_trainer.py).
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from grpo_flyte.config.training import TrainConfig
from grpo_flyte.learning import grpo, losses

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = trl_grpo.GRPOTrainer
nanstd = pytest.importorskip("trl.trainer.utils").nanstd

MAX_COMPLETION = 8
LENGTHS = [5, 3, 8, 0, 1, 6]  # rollout 3 is masked (TRL's mask_truncated_completions: an all-zero row)


class _Accelerator:
    """One process: gather, reduce and pad return their input."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trl_self(train: TrainConfig, logp: torch.Tensor, entropy: torch.Tensor, use_vllm: bool, last_entropy: float):
    """The attributes `_compute_loss` reads, with TRL's names, from a grpo_flyte TrainConfig."""
    fake = types.SimpleNamespace(
        loss_type=train.loss_type,
        epsilon_low=train.epsilon,
        epsilon_high=train.epsilon_high,
        beta=train.beta,
        importance_sampling_level=train.importance_sampling_level,
        top_entropy_quantile=train.top_entropy_quantile,
        off_policy_mask_threshold=train.off_policy_mask_threshold,
        use_vllm=use_vllm,
        vllm_importance_sampling_correction=use_vllm and train.is_correction,
        max_completion_length=MAX_COMPLETION,
        current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _entropy_bonus_enabled=train.entropy_coef != 0.0 or train.use_adaptive_entropy,
        entropy_coef=train.entropy_coef,
        use_adaptive_entropy=train.use_adaptive_entropy,
        _last_world_entropy=last_entropy,
        _entropy_window_stats=None,
        aux_loss_enabled=False,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        args=types.SimpleNamespace(
            delta=train.delta,
            sapo_temperature_pos=train.sapo_temperature_pos,
            sapo_temperature_neg=train.sapo_temperature_neg,
            vespo_k_pos=train.vespo_k_pos,
            vespo_lambda_pos=train.vespo_lambda_pos,
            vespo_k_neg=train.vespo_k_neg,
            vespo_lambda_neg=train.vespo_lambda_neg,
            use_bias_correction_kl=train.use_bias_correction_kl,
            steps_per_generation=1,
            entropy_target=train.entropy_target,
            entropy_coef_delta=train.entropy_coef_delta,
            entropy_coef_min=train.entropy_coef_min,
            entropy_coef_max=train.entropy_coef_max,
        ),
    )
    fake.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    fake._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, entropy, None)
    return fake


def trl_importance_sampling_ratio(old, samp, mask, train: TrainConfig):
    """TRL's vLLM importance-sampling ratio, copied from GRPOTrainer._generate_and_score_completions
    (trl/trainer/grpo_trainer.py, TRL 1.16, lines 2660-2708): (B, T) for token modes, (B, 1) for
    sequence modes."""
    diff = torch.nan_to_num((old - samp) * mask, nan=0.0)
    if train.is_mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    clip_min, clip_max = train.is_clip_min, train.is_cap
    if train.is_mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    return ratio.masked_fill((ratio < low) | (ratio > clip_max), value=0.0)


def _data(seed: int):
    """Padded (B, T) log-probs (the leaf), entropies (a leaf), old, sampling and reference log-probs,
    the mask and the advantages (one zero), from one seed."""
    gen = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    mask = (torch.arange(t).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).float()
    old = -torch.rand(b, t, generator=gen) * 3 - 0.05
    logp = (old + 0.4 * torch.randn(b, t, generator=gen)).clamp(max=-1e-3)
    samp = old + 0.1 * torch.randn(b, t, generator=gen)
    ref = old + 0.5 * torch.randn(b, t, generator=gen)
    entropy = torch.rand(b, t, generator=gen) * 2.0
    advantages = torch.randn(b, generator=gen)
    advantages[1] = 0.0
    return logp.requires_grad_(True), entropy.requires_grad_(True), old, samp, ref, mask, advantages


_TOKEN_BOUNDS = dict(is_cap=1.1, is_clip_min=0.9)
_SEQUENCE_BOUNDS = dict(is_cap=1.5, is_clip_min=0.8)
CASES = {
    **{f"{kind}": dict(loss_type=kind) for kind in ("grpo", "dr_grpo", "dapo", "bnpo", "sapo")},
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "vespo": dict(loss_type="vespo"),
    "luspo (sequence)": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "grpo sequence (GSPO)": dict(importance_sampling_level="sequence"),
    "sapo sequence": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "grpo delta": dict(delta=1.1, epsilon_high=0.05),
    "dapo delta epsilon_high": dict(loss_type="dapo", delta=1.3, epsilon_high=0.28),
    "grpo top_entropy_quantile": dict(top_entropy_quantile=0.3),
    "dr_grpo top_entropy_quantile 0": dict(loss_type="dr_grpo", top_entropy_quantile=0.0),
    "grpo entropy_coef": dict(entropy_coef=0.05),
    "dapo entropy_coef and quantile": dict(loss_type="dapo", entropy_coef=0.1, top_entropy_quantile=0.5),
    "grpo adaptive entropy": dict(use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=5.0),
    "grpo off_policy_mask": dict(off_policy_mask_threshold=0.05),
    "sapo off_policy_mask": dict(loss_type="sapo", off_policy_mask_threshold=0.0),
    "grpo beta bias-corrected": dict(beta=0.1),
    "grpo beta plain": dict(beta=0.1, use_bias_correction_kl=False),
    "grpo sequence beta bias-corrected": dict(beta=0.2, importance_sampling_level="sequence"),
    "cispo beta": dict(loss_type="cispo", beta=0.05, epsilon_high=5.0),
    # bounds that cut some of the ratios: per token exp(0.1 x noise), per sequence exp of a sum of up to 8
    **{f"grpo IS {mode}": dict(is_mode=mode, is_cap=1.05 if mode.startswith("token") else 1.3) for mode in losses.IS_MODES},
    **{
        f"dapo IS {mode} clip_min": dict(
            loss_type="dapo", is_mode=mode, **(_TOKEN_BOUNDS if mode.startswith("token") else _SEQUENCE_BOUNDS)
        )
        for mode in losses.IS_MODES
    },
    "vespo IS token_truncate": dict(loss_type="vespo", is_mode="token_truncate", **_TOKEN_BOUNDS),
    "vespo IS token_mask": dict(loss_type="vespo", is_mode="token_mask", **_TOKEN_BOUNDS),
    "sapo sequence IS sequence_truncate beta": dict(
        loss_type="sapo", importance_sampling_level="sequence", is_mode="sequence_truncate", beta=0.1
    ),
    "everything": dict(
        loss_type="dapo", delta=1.4, beta=0.05, top_entropy_quantile=0.6, entropy_coef=0.03, off_policy_mask_threshold=0.02, is_clip_min=0.7
    ),
}
WITH_IS = {name for name in CASES if " IS " in name or name == "everything"}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("old_given", [True, False])
def test_loss_and_gradients_equal_trls(name, old_given):
    settings = CASES[name]
    use_vllm = name in WITH_IS
    train = TrainConfig(**settings)
    logp, entropy, old, samp, ref, mask, advantages = _data(seed=sum(map(ord, name)) + old_given)
    if not old_given:  # TRL's old_per_token_logps None: the ratio is 1 (ours: the first minibatch)
        old = logp.detach()
    last_entropy = 0.5  # adaptive control: at or below the target, so the coefficient applies

    # TRL
    trl_self = _trl_self(train, logp, entropy, use_vllm, last_entropy)
    inputs = {
        "prompt_ids": torch.ones(len(LENGTHS), 1, dtype=torch.long),
        "prompt_mask": torch.ones(len(LENGTHS), 1, dtype=torch.long),
        "completion_ids": torch.ones(mask.shape, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old if old_given else None,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    if use_vllm:
        inputs["sampling_per_token_logps"] = samp
        inputs["importance_sampling_ratio"] = trl_importance_sampling_ratio(old, samp, mask, train)
    trl_loss = GRPOTrainer._compute_loss(trl_self, None, inputs)
    trl_grads = torch.autograd.grad(trl_loss, (logp, entropy), allow_unused=True)

    # grpo_flyte: the same numbers as flat (N,) vectors
    keep = mask.bool()
    rows = torch.nonzero(keep, as_tuple=True)[0]
    lengths = torch.tensor(LENGTHS)
    flat_h = entropy[keep]
    threshold = kept = None
    if train.top_entropy_quantile < 1.0:
        threshold = float(losses.entropy_threshold(flat_h, train.top_entropy_quantile))
        kept = int((flat_h >= threshold).sum())
    num_tokens = int(mask.sum())
    norm = losses.LossNormalizer(len(LENGTHS), num_tokens, MAX_COMPLETION, kept if kept is not None else num_tokens)
    control = losses.EntropyControl(train.entropy_coef, last_entropy)
    ours = losses.objective(
        logp[keep],
        flat_h,
        old[keep],
        advantages[rows],
        rows,
        lengths,
        train,
        norm,
        sampling_logprobs=samp[keep] if use_vllm else None,
        ref_logprobs=ref[keep] if train.beta > 0 else None,
        threshold=threshold,
        coef=control.applied(train),
    )
    our_grads = torch.autograd.grad(ours.loss, (logp, entropy), allow_unused=True)

    assert ours.loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    for theirs, mine in zip(trl_grads, our_grads, strict=True):
        theirs = torch.zeros_like(logp) if theirs is None else theirs
        mine = torch.zeros_like(logp) if mine is None else mine
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6), (mine - theirs).abs().max()
    if train.top_entropy_quantile > 0.0:  # a gradient reached the log-probs (one kept token may be clipped)
        assert our_grads[0].abs().sum() > 0
    if train.use_adaptive_entropy:  # the controller's next coefficient, measured over the same tokens
        measured = float(flat_h.detach().mean()) if threshold is None else float(flat_h.detach()[flat_h >= threshold].mean())
        assert control.updated(measured, train).coef == pytest.approx(trl_self.entropy_coef)
        assert measured == pytest.approx(trl_self._last_world_entropy, rel=1e-6)


# --------------------------------------------------------------------------- advantages


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards, aggregation):
    """TRL's advantages, copied from GRPOTrainer._generate_and_score_completions (trl/trainer/
    grpo_trainer.py, TRL 1.16, lines 2757-2806; its nanstd is TRL's own, trl.trainer.utils)."""
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        if scale_rewards in ["group", "none"]:
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean_grouped
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
        return advantages
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    std = nanstd(rewards).expand_as(rewards)
    return torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std + 1e-4), nan=0.0)


def _scored(scores: list[list[dict[str, float]]], weights: dict[str, float]):
    from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup

    groups = []
    for index, group in enumerate(scores):
        rollouts = [Rollout(completion_ids=[5, 2], sampling_logprobs=[-1.0, -1.0], finish_reason="stop", text="x") for _ in group]
        parts = [RewardParts(reward=sum(weights[k] * v for k, v in s.items()), correct=False, format=False, scores=s) for s in group]
        rollout_group = RolloutGroup(index=index, example=Example(question="q", answer="1"), adapter_version=0,
                                     prompt_ids=[1, 3], rollouts=rollouts, generate_s=0.0)  # fmt: skip
        groups.append(ScoredGroup(group=rollout_group, rewards=parts))
    return groups


@pytest.mark.parametrize(
    ("scale_rewards", "aggregation"),
    [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"), ("group", "normalize_then_sum")],
)
def test_advantages_equal_trls(scale_rewards, aggregation):
    gen = torch.Generator().manual_seed(7)
    weights = {"correct": 1.0, "format": 0.3, "length": -0.5}
    num_groups, group_size = 3, 4
    per_func = torch.rand(num_groups * group_size, len(weights), generator=gen, dtype=torch.float64)
    per_func[:, 0] = (per_func[:, 0] > 0.5).double()  # a 0/1 reward
    scores = [
        [dict(zip(weights, per_func[g * group_size + i].tolist(), strict=True)) for i in range(group_size)] for g in range(num_groups)
    ]
    expected = trl_advantages(per_func, torch.tensor(list(weights.values()), dtype=torch.float64), group_size, scale_rewards, aggregation)
    train = TrainConfig(scale_rewards=scale_rewards, multi_objective_aggregation=aggregation, truncated="keep")
    from grpo_flyte.learning.update import build_sequences

    sequences, _ = build_sequences(_scored(scores, weights), train, weights)
    # (rel 1e-7: TRL's nanstd takes its n / (n - 1) in float32)
    assert [s.advantage for s in sequences] == pytest.approx(expected.tolist(), rel=1e-7, abs=1e-12)


def test_batch_scaling_by_hand():
    # groups [1, 0] and [3, 1, 2]: centred [0.5, -0.5] and [1, -1, 0]; the batch's sample std of
    # [1, 0, 3, 1, 2] (mean 1.4): sqrt((0.16 + 1.96 + 2.56 + 0.16 + 0.36) / 4) = sqrt(1.3)
    s = math.sqrt(1.3)
    out = grpo.batch_advantages([[1.0, 0.0], [3.0, 1.0, 2.0]], 1e-4, "batch")
    assert out[0] == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4)])
    assert out[1] == pytest.approx([1 / (s + 1e-4), -1 / (s + 1e-4), 0.0])
    assert grpo.batch_advantages([[2.0, 2.0], [1.0, 0.0]], 1e-4, "batch")[0] == [0.0, 0.0]  # no spread: exactly 0


def test_normalize_then_sum_by_hand_and_the_truncation_floor():
    # one group of 3, two rewards: a = [1, 0, 0] (mean 1/3, sample std 1/sqrt(3)), b = [0, 0, 1];
    # weights 1 and 2. z_a = [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)] (eps 0 here), z_b the mirror
    scores = [{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 1.0}]
    sums = grpo.normalized_sums(scores, {"a": 1.0, "b": 2.0}, eps=0.0)
    r3 = math.sqrt(3)
    assert sums == pytest.approx([2 / r3 - 2 / r3, -1 / r3 - 2 / r3, -1 / r3 + 4 / r3])
    # a reward that scored one completion only adds nothing; a completion no reward scored is None
    assert grpo.normalized_sums([{"a": 1.0}, {}], {"a": 1.0}, eps=0.0) == [0.0, None]
    # with truncated='min_reward' a cut completion gets the group's lowest sum before the batch step
    from grpo_flyte.learning.update import build_sequences

    groups = _scored([scores], {"a": 1.0, "b": 2.0})
    groups[0].group.rollouts[2].finish_reason = "length"
    train = TrainConfig(multi_objective_aggregation="normalize_then_sum", advantage_eps=1e-4)
    sequences, _ = build_sequences(groups, train, {"a": 1.0, "b": 2.0})
    floored = grpo.normalized_sums(scores, {"a": 1.0, "b": 2.0}, eps=1e-4)
    floored[2] = min(floored)
    assert [s.advantage for s in sequences] == pytest.approx(grpo.batch_normalized([floored], 1e-4)[0])
    assert sequences[2].advantage == sequences[1].advantage < sequences[0].advantage
