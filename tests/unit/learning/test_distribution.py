"""The sampling distribution's rules by hand on a vocabulary of 5, and the decoder's and the
trainer's log-probs of the same tokens on the tiny model (their importance ratio is 1)."""

import math

import pytest
import torch

from grpo_flyte.engine.sampling import Sampling, choose_tokens, row_stream
from grpo_flyte.learning import distribution
from grpo_flyte.learning.distribution import Rules, SeenTokens, kept_count, penalize, processed_logprobs_and_entropy

P = [0.05, 0.1, 0.15, 0.3, 0.4]


def kept(probs, temperature=1.0, **rules):
    """The token ids the rules keep for one row of probabilities."""
    logp = torch.log_softmax(torch.tensor([probs], dtype=torch.float64).log() / temperature, -1)
    ordered, order = logp.sort(-1, descending=True)
    n = int(kept_count(ordered, Rules(temperature, **rules))[0])
    return sorted(order[0, :n].tolist())


def trained(probs, targets, temperature=1.0, seen=None, **rules):
    logits = torch.tensor([probs] * len(targets), dtype=torch.float64).log()
    return processed_logprobs_and_entropy(logits, torch.tensor(targets), Rules(temperature, **rules), seen)[0].tolist()


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    assert kept(P, min_p=0.5) == [3, 4]  # threshold 0.5 x 0.4 = 0.2
    assert kept(P, min_p=0.74) == [3, 4]  # 0.3 >= 0.296
    assert kept(P, min_p=0.76) == [4]
    assert trained(P, [3, 4], min_p=0.5) == pytest.approx([math.log(0.3 / 0.7), math.log(0.4 / 0.7)], abs=1e-12)


def test_min_p_applies_to_the_distribution_after_temperature():
    probs = [0.01, 0.04, 0.04, 0.16, 0.75]
    assert kept(probs, min_p=0.2) == [3, 4]  # T = 1: threshold 0.15
    # T = 2: p ~ sqrt(p) = 0.1, 0.2, 0.2, 0.4, 0.866; threshold 0.2 x 0.866 = 0.173 keeps 0.2 and up
    assert kept(probs, temperature=2.0, min_p=0.2) == [1, 2, 3, 4]
    roots = [math.sqrt(p) for p in probs]
    assert trained(probs, [1], temperature=2.0, min_p=0.2) == pytest.approx([math.log(roots[1] / sum(roots[1:]))], abs=1e-12)


def test_top_k_keeps_the_k_most_likely_and_every_token_tied_with_the_kth():
    assert kept(P, top_k=2) == [3, 4]
    assert kept(P, top_k=5) == kept(P, top_k=9) == kept(P, top_k=0) == kept(P, top_k=-1) == [0, 1, 2, 3, 4]
    tied = [0.1, 0.2, 0.2, 0.2, 0.3]
    assert kept(tied, top_k=2) == [1, 2, 3, 4]  # the 2nd largest, 0.2, is shared by three
    assert trained(tied, [2], top_k=2) == pytest.approx([math.log(0.2 / 0.9)], abs=1e-12)


def test_top_p_keeps_tokens_until_the_mass_before_reaches_top_p():
    assert kept(P, top_p=0.6) == [3, 4]  # mass before: 0, 0.4, 0.7
    assert kept(P, top_p=0.69) == [3, 4]
    assert kept(P, top_p=0.71) == [2, 3, 4]
    assert kept(P, top_p=0.01) == [4]  # the first always stays
    assert trained(P, [2], top_p=0.71) == pytest.approx([math.log(0.15 / 0.85)], abs=1e-12)


def test_top_p_is_taken_over_what_top_k_and_min_p_kept_renormalized():
    # top_k 3 keeps 0.4, 0.3, 0.15 (mass 0.85), renormalized 0.471, 0.353, 0.176: the mass before
    # 0.15 is 0.824 >= 0.8, so top_p 0.8 drops it (over the unrenormalized distribution, 0.7 < 0.8 would keep it)
    assert kept(P, top_p=0.8) == [2, 3, 4]
    assert kept(P, top_k=3, top_p=0.8) == [3, 4]
    assert kept(P, min_p=0.3, top_p=0.8) == [3, 4]  # min_p 0.3 keeps the same three (threshold 0.12)
    assert kept(P, top_k=3, min_p=0.5) == [3, 4]  # both apply: the smaller set
    assert trained(P, [3], top_k=3, top_p=0.8) == pytest.approx([math.log(0.3 / 0.7)], abs=1e-12)


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5]])
    seen = torch.tensor([[True, True, False, False, True]])
    assert penalize(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 1.0, -1.0]]
    assert penalize(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, 1.0, -0.25]]
    # before the temperature: log softmax([1, -2, 0.5, 1, -1] / 2) at token 3
    x = [1.0, -2.0, 0.5, 1.0, -1.0]
    expected = 0.5 - math.log(sum(math.exp(v / 2) for v in x))
    rows = SeenTokens(first=torch.tensor([[0, 1, 9, 9, 2]]), rows=torch.tensor([0]), positions=torch.tensor([2]))
    lp, _ = processed_logprobs_and_entropy(logits, torch.tensor([3]), Rules(2.0, repetition_penalty=2.0), rows)
    assert lp.tolist() == pytest.approx([expected], abs=1e-6)
    # the decoder's draw and log-prob use the same penalized distribution
    tokens, drawn = choose_tokens(logits, Sampling(2.0, 1.0, 1, repetition_penalty=2.0), torch.tensor([0.999]), seen=seen)
    assert tokens.tolist() == [4] and drawn.tolist() == pytest.approx([-0.5 - math.log(sum(math.exp(v / 2) for v in x))], abs=1e-6)


def test_seen_tokens_of_a_batch_are_each_positions_prompt_and_completion_so_far():
    # row 0: prompt [5, 6], completion [7, 5, 8]; row 1: prompt [9], completion [6, 6], right-padded with 0
    input_ids = torch.tensor([[5, 6, 7, 5, 8], [9, 6, 6, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    predict = torch.tensor([[False, True, True, True, False], [True, True, False, False, False]])
    seen = SeenTokens.of_batch(input_ids, attention, predict, vocab=10)
    mask = seen.mask(slice(0, 5))
    as_sets = [set(torch.nonzero(row).squeeze(-1).tolist()) for row in mask]
    assert as_sets == [{5, 6}, {5, 6, 7}, {5, 6, 7}, {9}, {9, 6}]  # padding (0) is never seen


def test_the_trainers_gradient_is_that_of_the_formula(monkeypatch):
    """The chunked autograd function against autograd through the same arithmetic written plainly."""
    monkeypatch.setattr(distribution, "CHUNK_ELEMENTS", 12)  # 2 rows of 6 a chunk
    torch.manual_seed(0)
    logits = (torch.randn(5, 6, dtype=torch.float64) * 2).requires_grad_(True)
    targets = torch.tensor([0, 1, 2, 3, 5])
    seen_mask = torch.rand(5, 6) < 0.4
    seen = SeenTokens(first=torch.where(seen_mask, 0, 9), rows=torch.arange(5), positions=torch.zeros(5, dtype=torch.long))
    rules = Rules(0.7, top_p=0.8, top_k=4, min_p=0.05, repetition_penalty=1.3)
    lp, entropy = processed_logprobs_and_entropy(logits, targets, rules, seen)
    weights = torch.linspace(-1, 1, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad((lp * weights).sum(), logits)

    z = penalize(logits, seen_mask, 1.3) / 0.7
    logp = torch.log_softmax(z, -1)
    ordered, order = logp.detach().sort(-1, descending=True)
    n = kept_count(ordered, rules)
    keep = torch.zeros_like(seen_mask)
    for i in range(5):
        keep[i, order[i, : n[i]]] = True
        keep[i, targets[i]] = True
    plain = logp.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logp.masked_fill(~keep, float("-inf")), -1)
    (expected,) = torch.autograd.grad((plain * weights).sum(), logits)
    assert lp.tolist() == pytest.approx(plain.tolist(), abs=1e-12)
    assert grad.tolist() == [pytest.approx(row, abs=1e-12) for row in expected.tolist()]
    assert entropy.tolist() == pytest.approx((-(logp.exp() * logp).sum(-1)).tolist(), abs=1e-12)
    assert not keep.all()  # the rules left tokens out


def test_the_decoder_never_draws_outside_the_kept_set_and_draws_it_in_proportion():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 1.5, 0.0]])
    seen = torch.tensor([[True, False, False, True, False, False, False]])
    # penalized / T: 1.667, -1.25, 0.625, 0.833, -0.625, 1.875, 0 -> p = .297 .016 .105 .129 .030 .366 .056;
    # min_p drops 1 and 4 (< 0.0366), top_k 2 and 6; top_p over {5, 0, 3, 2} renormalized (.408 .331
    # .144 .117) drops 2 (the mass before it, 0.883, is past 0.8)
    sampling = Sampling(0.8, 0.8, 1, top_k=4, min_p=0.1, repetition_penalty=1.5)
    z = penalize(logits, seen, 1.5) / 0.8
    logp = torch.log_softmax(z, -1)
    ordered, order = logp.sort(-1, descending=True)
    allowed = order[0, : int(kept_count(ordered, sampling.rules)[0])].tolist()
    assert allowed == [5, 0, 3]
    stream = row_stream(3, 0)
    uniforms = torch.tensor([stream.random() for _ in range(20_000)], dtype=torch.float64)
    n = len(uniforms)
    tokens, drawn = choose_tokens(logits.expand(n, 7), sampling, uniforms, seen=seen.expand(n, 7))
    assert set(tokens.tolist()) == set(allowed)
    renormalized = logp[0, allowed] - torch.logsumexp(logp[0, allowed], -1)
    freq = torch.bincount(tokens, minlength=7).double() / n
    assert freq[allowed].tolist() == pytest.approx(renormalized.exp().tolist(), abs=0.015)
    assert drawn.tolist() == pytest.approx(renormalized[[allowed.index(t) for t in tokens.tolist()]].tolist(), abs=1e-6)


# The decoder on the tiny model, the trainer on the same tokens: the log-probs agree for each rule
# alone and all together (float64, as tests/unit/engine/test_decoding.py runs the loop). The random
# model's logits are nearly flat (std 0.11): at temperature 0.05 its distribution has a few likely
# tokens, so that each rule changes it.

CASES = {
    "top_k": {"top_k": 20},
    "min_p": {"min_p": 0.4},
    "top_p": {"top_p": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.8},
    "all": {"top_k": 200, "min_p": 0.2, "top_p": 0.7, "repetition_penalty": 1.3},
}


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    # a LoRA adapter initialized to zero: the trainer's policy is the decoder's model
    trainer = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval(),
        LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    return model, trainer


@pytest.mark.parametrize("case", list(CASES))
def test_the_decoders_logprobs_are_the_trainers(tiny_pair, case):
    from grpo_flyte.config.run import RunConfig
    from grpo_flyte.engine.decode_loop import DecodeCall, decode
    from grpo_flyte.learning import update
    from grpo_flyte.learning.grpo import TrainSequence

    model, trainer = tiny_pair
    settings = CASES[case]
    sampling = Sampling(temperature=0.05, max_new_tokens=12, **{"top_p": 1.0, **settings})
    prompts = [[1, 2, 3, 2, 5, 6, 7], [8, 9, 8], [11, 12, 13, 14, 15]]
    with torch.inference_mode():
        rows = decode(model, prompts, DecodeCall([(5, r) for r in range(3)], sampling, {49151}, pad_id=0))
    config = RunConfig(temperature=0.05, **settings).sampling
    sequences = [TrainSequence(p, ids, 1.0, lps) for p, (ids, lps) in zip(prompts, rows, strict=True)]
    with torch.no_grad():
        recomputed, _, _ = update._completion_logprobs(trainer, sequences, config)
        plain, _, _ = update._completion_logprobs(trainer, sequences, RunConfig(temperature=0.05).sampling)
    sampled = torch.tensor([lp for _, lps in rows for lp in lps], dtype=torch.float64)
    assert sampled.numel() == 36
    ratio = (recomputed.double() - sampled).exp()
    assert ratio.tolist() == pytest.approx([1.0] * 36, abs=1e-5)  # the decoder draws in float32
    # the rule changed the distribution (both sides ignoring it would also agree)
    assert (plain.double() - sampled).abs().max() > 1e-3
