"""The trainer's GRPO step on real (tiny) models: what is forwarded, what the loss divides by,
which old policy the first update uses, and logits equal to the model's own forward."""

from __future__ import annotations

import math
from pathlib import Path

import flyte
import pytest
import torch
from flyte.io import Dir

from grpo_flyte import trainer
from grpo_flyte.config.run import RunConfig
from grpo_flyte.learning import data_parallel, grpo, losses, merge, policy
from grpo_flyte.learning import update as policy_update
from grpo_flyte.learning.grpo import TrainSequence

A = TrainSequence(prompt_ids=[1, 5, 6], completion_ids=[11, 12, 2], advantage=1.0)
B = TrainSequence(prompt_ids=[1, 5, 6], completion_ids=[13, 2], advantage=-1.0)
C = TrainSequence(prompt_ids=[1, 7], completion_ids=[14, 15, 16, 2], advantage=0.0)
D = TrainSequence(prompt_ids=[1, 7], completion_ids=[17, 2], advantage=0.0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A one-layer random Llama (64-token vocabulary, no tokenizer: the trainer needs none)."""
    path = tmp_path_factory.mktemp("llama")
    _base("llama").save_pretrained(path)
    return path


@pytest.fixture
def fresh(llama_dir):
    """The tiny Llama with a fresh seeded LoRA adapter (B = 0) and a fresh optimizer, per call.
    On a machine with a GPU the trainer puts it there (`models.best_device`)."""

    def make(**settings):
        config = RunConfig(model=str(llama_dir), dtype="float32", max_new_tokens=8, **settings)
        model = policy.peft_model(config.base, config.lora, str(llama_dir))
        policy.reset_lora(model, seed=0)
        return model, policy._optimizer(model, config.train), config

    return make


def _step(fresh, sequences, **settings):
    model, optimizer, config = fresh(**settings)
    return policy_update.grpo_step(model, optimizer, sequences, config.train, config.sampling)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_the_normalizer_counts_rollouts_left_out_of_the_forward_pass(fresh, loss_type):
    # Two zero-advantage rollouts (C, D) are not forwarded, but they are half of the batch: as in
    # TRL, the loss over A and B is divided by all four rollouts (grpo, dr_grpo) or by all their
    # tokens (dapo), so its gradient is the two-rollout one times 2/4 or times 5/11. (The loss
    # itself is 0 at ratio 1 when a group's advantages sum to 0; the gradient is not.)
    alone = _step(fresh, [A, B], loss_type=loss_type)
    with_zeros = _step(fresh, [A, B, C, D], loss_type=loss_type)
    assert alone.num_tokens == with_zeros.num_tokens == 5  # C and D never went through the model
    scale = 5 / 11 if loss_type == "dapo" else 2 / 4
    assert alone.grad_norm > 0
    assert with_zeros.grad_norm == pytest.approx(alone.grad_norm * scale, rel=1e-4)


def test_masked_rollouts_count_as_rollouts_not_as_tokens(fresh):
    masked = TrainSequence(C.prompt_ids, C.completion_ids, advantage=2.0, masked=True)
    alone = _step(fresh, [A, B], loss_type="dapo")
    with_masked = _step(fresh, [A, B, masked], loss_type="dapo")
    assert with_masked.grad_norm == pytest.approx(alone.grad_norm, rel=1e-4)  # T = 5 tokens both times
    assert with_masked.num_tokens == 5
    grpo_alone = _step(fresh, [A, B], loss_type="grpo")
    assert _step(fresh, [A, B, masked], loss_type="grpo").grad_norm == pytest.approx(grpo_alone.grad_norm * 2 / 3, rel=1e-4)


def test_with_beta_the_zero_advantage_rollouts_keep_their_kl_term(fresh):
    # beta > 0: C and D have no surrogate gradient but a KL pull towards the reference
    assert _step(fresh, [A, B, C, D], beta=0.1).num_tokens == 3 + 2 + 4 + 2
    assert _step(fresh, [A, B, C, D], beta=0.0).num_tokens == 3 + 2
    assert [grpo.in_loss(s, 0.1) for s in (A, C)] == [True, True]
    assert [grpo.in_loss(s, 0.0) for s in (A, C)] == [True, False]


def _spy_old_logprobs(monkeypatch) -> tuple[list[set[int]], list]:
    """(the sequences each reference pass computed old log-probs for, each token loss's log-ratio
    logp - old), recorded as the train step runs."""
    needed, log_ratios = [], []
    reference_pass, token_loss = policy_update._reference_pass, losses.token_loss

    def spy_reference(model, sequences, trained, need_old, *rest):
        needed.append(set(need_old))
        return reference_pass(model, sequences, trained, need_old, *rest)

    def spy_loss(logprobs, old, *rest, **kw):
        log_ratios.append((logprobs - old).detach())
        return token_loss(logprobs, old, *rest, **kw)

    monkeypatch.setattr(policy_update, "_reference_pass", spy_reference)
    monkeypatch.setattr(losses, "token_loss", spy_loss)
    return needed, log_ratios


def test_a_batch_with_no_signal_takes_no_optimizer_step(fresh):
    model, optimizer, config = fresh()
    before = [p.detach().clone() for p in policy.trainable(model)]
    stats = policy_update.grpo_step(model, optimizer, [C, D], config.train, config.sampling)
    assert stats.num_updates == 0 and stats.num_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.trainable(model), strict=True))


def test_the_first_minibatch_uses_the_current_policy_as_old(fresh, monkeypatch):
    # With several updates, only the later minibatches need log-probs from before the first step;
    # the first one's ratio is exactly 1, not noise from a separately batched pass.
    needed, log_ratios = _spy_old_logprobs(monkeypatch)
    sequences = [A, B, TrainSequence(A.prompt_ids, [18, 2], 0.5), TrainSequence(B.prompt_ids, [19, 20, 2], -0.5)]
    stats = _step(fresh, sequences, updates_per_iter=2, learning_rate=5e-2)
    assert stats.num_updates == 2
    assert needed == [set(grpo.split_minibatches(4, 2)[1])]  # minibatch 0 = [0, 2], 1 = [1, 3]
    assert len(log_ratios) == 2  # one micro-batch per minibatch
    assert torch.equal(log_ratios[0], torch.zeros_like(log_ratios[0]))
    assert log_ratios[1].abs().max() > 0  # after a step the policy moved from the old one


def _base(kind: str):
    """A one-layer random model of an architecture that post-processes its logits (or Llama)."""
    import transformers

    common = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    if kind == "gemma2":  # final logit soft-capping: cap * tanh(logits / cap)
        config, cls = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.5), transformers.Gemma2ForCausalLM
    elif kind == "granite":  # logits / logits_scaling
        config, cls = transformers.GraniteConfig(**common, logits_scaling=8.0), transformers.GraniteForCausalLM
    elif kind == "cohere":  # logits * logit_scale
        config, cls = transformers.CohereConfig(**common, logit_scale=4.0), transformers.CohereForCausalLM
    else:
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return cls(config).eval()


def _tiny(kind: str):
    """`_base(kind)` with a LoRA adapter."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_base(kind), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("kind", ["gemma2", "granite", "cohere", "llama"])
def test_the_trainer_differentiates_the_models_own_logits(kind):
    model = _tiny(kind)
    assert policy_update.head_is_the_forward(model) == (kind == "llama")
    sequences = [TrainSequence([1, 2, 3], [4, 5], 1.0), TrainSequence([6], [7, 8, 9], -1.0)]
    sampling = RunConfig(temperature=0.7).sampling
    with torch.no_grad():
        logprobs, _, _ = policy_update._completion_logprobs(model, sequences, sampling)
        expected = []
        for s in sequences:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / 0.7, dim=-1)
            p = len(s.prompt_ids)
            expected += [logp[p - 1 + t, tok] for t, tok in enumerate(s.completion_ids)]
    assert logprobs.tolist() == pytest.approx(torch.stack(expected).tolist(), abs=1e-5)


def test_on_a_cpu_the_trainer_attends_with_grouped_attention_and_differentiates_as_sdpa(llama_dir):
    # loading.load_base gives the trainer grouped attention on a CPU; on right-padded rows of four
    # lengths its log-probs and LoRA gradients are those of transformers' fused attention.
    from peft import LoraConfig, get_peft_model

    from grpo_flyte.models import loading
    from grpo_flyte.models.attention import GROUPED_ATTENTION
    from grpo_flyte.runtime import device

    base = loading.load_base(str(llama_dir), "float32")
    expected = GROUPED_ATTENTION if device.best_device() == "cpu" else "sdpa"
    assert base.config._attn_implementation == expected
    model = get_peft_model(base.double(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    sequences, sampling = [A, B, C, D], RunConfig(temperature=0.7).sampling
    results = {}
    for attention in (GROUPED_ATTENTION, "sdpa"):
        model.base_model.model.set_attn_implementation(attention)
        model.zero_grad()
        logprobs, _, _ = policy_update._completion_logprobs(model, sequences, sampling)
        (logprobs * torch.linspace(-1, 1, len(logprobs), dtype=torch.float64)).sum().backward()
        results[attention] = logprobs.detach(), [p.grad.clone() for p in policy.trainable(model)]
    (ours, our_grads), (theirs, their_grads) = results.values()
    assert torch.allclose(ours, theirs, atol=1e-6)
    # eager attention's softmax is float32 whatever the model's type (grouped attention does as it does)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(our_grads, their_grads, strict=True))
    assert all(g.abs().max() > 0 for g in our_grads)


# --------------------------------------------------------------------------- the warm trainer

warm_env = flyte.TaskEnvironment(name="grpo_flyte-test-warm")


def _scored_groups() -> list:
    from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup

    groups = []
    for index in range(2):
        rollouts = [
            Rollout(completion_ids=[11 + index, 12, 2], sampling_logprobs=[-4.0] * 3, finish_reason="stop", text="a"),
            Rollout(completion_ids=[13, 2], sampling_logprobs=[-4.0] * 2, finish_reason="stop", text="b"),
        ]
        group = RolloutGroup(index=index, example=Example(question="q", answer="1"), adapter_version=0,
                             prompt_ids=[1, 5, 6, 7], rollouts=rollouts, generate_s=0.0)  # fmt: skip
        parts = [RewardParts(reward=1.0, correct=True, format=False), RewardParts(reward=0.0, correct=False, format=False)]
        groups.append(ScoredGroup(group=group, rewards=parts))
    return groups


@warm_env.task
async def three_steps(config: RunConfig, base: Dir, cold: bool) -> list[str]:
    """init_adapter, then three train_steps; `cold` forgets the replica's warm optimizer between them."""
    adapter = await trainer.init_adapter(config.base, config.lora, config.seed, base)
    for _ in range(3):
        if cold:
            trainer._warm.clear()
        result = await trainer.train_step(config.base, config.lora, config.train, config.sampling, base, adapter, _scored_groups())
        adapter = result.adapter
    return [adapter.dir.path]


def test_a_warm_trainer_goes_on_from_memory_with_the_result_of_a_cold_one(tmp_path, llama_dir, monkeypatch):
    from safetensors.torch import load_file

    loads = []
    load = policy.load_adapter_state
    monkeypatch.setattr(policy, "load_adapter_state", lambda *a, **k: loads.append(a[1]) or load(*a, **k))
    config = RunConfig(model=str(llama_dir), dtype="float32", group_size=2, learning_rate=1e-2, max_new_tokens=8)
    outputs = {}
    for cold in (False, True):
        run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / f"raw-{cold}")).run(
            three_steps, config=config, base=Dir(path=str(llama_dir)), cold=cold
        )
        outputs[cold] = load_file(str(Path(run.outputs()[0][0]) / "adapter_model.safetensors"))
        optimizer = torch.load(Path(run.outputs()[0][0]) / "optimizer.pt", weights_only=True)
        outputs[cold]["step"] = torch.tensor([float(s["step"]) for s in optimizer["state"].values()])
    warm_loads, cold_loads = loads[:1], loads[1:]
    assert len(warm_loads) == 1 and len(cold_loads) == 3  # warm: only the first step reads its adapter back
    assert outputs[False].keys() == outputs[True].keys()
    assert all(torch.equal(outputs[False][k], outputs[True][k]) for k in outputs[False])  # bit-identical


# --------------------------------------------------------------------------- schedule and checkpointing


def test_each_optimizer_step_takes_its_scheduled_learning_rate(fresh, monkeypatch):
    """Two updates per iteration, linear decay over 4 steps: the second iteration (steps 2 and 3)
    steps with lr x 2/4 and lr x 1/4, in that order."""
    model, optimizer, config = fresh(updates_per_iter=2, lr_scheduler_type="linear", learning_rate=0.01)
    seen = []
    step = optimizer.step

    def record(*args, **kwargs):
        seen.append(optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    monkeypatch.setattr(optimizer, "step", record)
    stats = policy_update.grpo_step(model, optimizer, [A, B, A, B], config.train, config.sampling, steps=(2, 4))
    assert seen == pytest.approx([0.01 * 2 / 4, 0.01 * 1 / 4]) and stats.lr == pytest.approx(0.0025)


def test_gradient_checkpointing_gives_the_same_step(fresh):
    """Recomputing activations changes memory, not the result: the same loss and gradient norm."""

    def layer_calls(model, run) -> tuple:
        calls = []
        # inside the layer: the recompute calls the layer's forward, not its hooks, but the attention's
        attention = model.base_model.model.model.layers[0].self_attn
        hook = attention.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        try:
            result = run()
            return result, calls.count(True)
        finally:
            hook.remove()

    model, optimizer, config = fresh(gradient_checkpointing=False)
    plain, plain_calls = layer_calls(model, lambda: policy_update.grpo_step(model, optimizer, [A, B, C], config.train, config.sampling))
    model, optimizer, config = fresh(gradient_checkpointing=True)
    checkpointed, calls = layer_calls(model, lambda: policy_update.grpo_step(model, optimizer, [A, B, C], config.train, config.sampling))
    assert policy_update._checkpointing_api(model)[0]
    assert calls == 2 * plain_calls  # each layer's forward runs again in the backward pass
    assert checkpointed.loss == pytest.approx(plain.loss, abs=1e-6)
    assert checkpointed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    policy_update.grpo_step(model, optimizer, [A, B], config.train.model_copy(update={"gradient_checkpointing": False}), config.sampling)
    assert not policy_update._checkpointing_api(model)[0]  # the cached model follows each step's config


def test_a_sequence_longer_than_the_micro_batch_budget_trains_with_checkpointed_activations(fresh, monkeypatch):
    """A sequence is never split: one longer than micro_batch_tokens trains alone, and its
    activations are recomputed in the backward pass (kept, their memory would grow with it); the
    others train as configured. The step is the one without checkpointing, to float rounding."""
    long = TrainSequence(prompt_ids=[1, *range(3, 60), *range(3, 20)], completion_ids=[11, 12, 13, 2], advantage=1.0)  # 79 tokens

    def step(**settings):
        model, optimizer, config = fresh(micro_batch_tokens=64, **settings)
        calls = []  # the tokens of each forward of layer 0's attention (a recomputed layer's runs twice)
        model.base_model.model.model.layers[0].self_attn.register_forward_hook(
            lambda module, args, kwargs, out: calls.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
        )
        stats = policy_update.grpo_step(model, optimizer, [A, long, B], config.train, config.sampling)
        return stats, [n for n in calls if n in (6, 79)], torch.cat([p.detach().flatten() for p in policy.trainable(model)])

    auto, auto_calls, auto_weights = step()
    # A and B (one micro-batch, 6 wide) once, the long one and its recompute in the backward pass
    assert sorted(auto_calls) == [6, 79, 79]
    monkeypatch.setattr(policy_update, "checkpointed", lambda train, lengths, budget: False)
    kept, kept_calls, kept_weights = step()
    assert sorted(kept_calls) == [6, 79]
    assert auto.loss == pytest.approx(kept.loss, abs=1e-6)
    assert auto.grad_norm == pytest.approx(kept.grad_norm, rel=1e-5)
    assert torch.allclose(auto_weights, kept_weights, atol=1e-7)


def test_only_a_step_with_a_sequence_longer_than_the_micro_batch_hands_its_memory_back(fresh, monkeypatch):
    """The long step runs inside `allocator.handing_back(True)` (its memory goes back to the kernel
    when it ends); a step of short sequences keeps its pages for the next step (False)."""
    from grpo_flyte.runtime import allocator

    seen = []
    real = allocator.handing_back
    monkeypatch.setattr(allocator, "handing_back", lambda oversized, **kw: seen.append(oversized) or real(oversized, **kw))
    long = TrainSequence(prompt_ids=[1, *range(3, 60), *range(3, 20)], completion_ids=[11, 12, 13, 2], advantage=1.0)  # 79 tokens
    model, optimizer, config = fresh(micro_batch_tokens=64)
    policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling)
    policy_update.grpo_step(model, optimizer, [A, long, B], config.train, config.sampling)
    assert seen == [False, True]


def test_with_beta_0_the_kl_is_measured_every_n_iterations_only(fresh):
    """beta 0: the KL is only a metric, so its reference pass runs on iterations N, 2N, ... (the
    others report none); with beta > 0 it is in the loss and runs every time."""
    model, optimizer, config = fresh(beta=0.0, kl_monitor_every=2)
    first = policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling, steps=(0, 10))  # iteration 1
    second = policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling, steps=(1, 10))  # iteration 2
    assert first.kl is None and second.kl is not None and second.kl >= 0
    model, optimizer, config = fresh(beta=0.0, kl_monitor_every=0)
    assert policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling, steps=(1, 10)).kl is None
    model, optimizer, config = fresh(beta=0.04, kl_monitor_every=0)
    assert policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling, steps=(0, 10)).kl is not None


def _with_sampling_logprobs(sequence: TrainSequence, value: float) -> TrainSequence:
    return TrainSequence(
        prompt_ids=sequence.prompt_ids,
        completion_ids=sequence.completion_ids,
        advantage=sequence.advantage,
        sampling_logprobs=[value] * len(sequence.completion_ids),
    )


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_each_importance_sampling_mode_weighs_the_step_and_reports_its_guards(fresh, mode):
    """Sampling log-probs far below the trainer's (an old, stale policy): every ratio is above a
    cap of 1, so truncation keeps weight 1 on every token and masking drops them all (no gradient)."""
    far_below = [_with_sampling_logprobs(s, -30.0) for s in (A, B)]
    stats = _step(fresh, far_below, is_cap=1.0, is_mode=mode)
    assert stats.num_tokens == 5 and stats.is_ratio_mean > 1
    assert stats.is_clipped_fraction == 1.0  # every token's weight was cut by the cap
    if mode.endswith("truncate"):
        assert stats.is_ess == pytest.approx(1.0) and stats.grad_norm > 0  # all weights 1
    else:
        assert stats.is_ess == 0.0 and stats.grad_norm == 0.0  # all weights 0
    # the generator's own log-probs: ratios near 1, nothing cut, a full effective sample
    model, optimizer, config = fresh(is_mode=mode)
    own = policy_update._completion_logprobs(model, [A, B], config.sampling)[0].detach().tolist()
    exact = [
        TrainSequence(prompt_ids=s.prompt_ids, completion_ids=s.completion_ids, advantage=s.advantage, sampling_logprobs=lps)
        for s, lps in zip((A, B), (own[:3], own[3:]), strict=True)
    ]
    stats = policy_update.grpo_step(model, optimizer, exact, config.train, config.sampling)
    assert stats.is_clipped_fraction == 0.0 and stats.is_ess == pytest.approx(1.0, abs=1e-5)


# --------------------------------------------------------------------------- data-parallel steps (--train-processes)


@warm_env.task
async def one_step(config: RunConfig, base: Dir, groups: int) -> tuple[str, float, int, float]:
    """init_adapter, then one train_step on `groups` hand-made groups: (adapter folder, loss, world size, kl)."""
    trainer._warm.clear()
    adapter = await trainer.init_adapter(config.base, config.lora, config.seed, base)
    scored = [sg for i in range(0, groups, 2) for sg in _scored_groups()]
    scored = [sg.model_copy(update={"group": sg.group.model_copy(update={"index": i})}) for i, sg in enumerate(scored)]
    result = await trainer.train_step(config.base, config.lora, config.train, config.sampling, base, adapter, scored)
    return result.adapter.dir.path, result.stats.loss, result.stats.world_size, result.stats.kl or 0.0


def test_a_two_process_step_equals_the_one_process_step(tmp_path, llama_dir):
    """Two gloo processes, each forwarding its share of every minibatch, all-reducing the LoRA
    gradients: the same adapter as one process (float32, largest difference <= 1e-4), the same loss
    and KL; the optimizer state is written once, by rank 0."""
    from safetensors.torch import load_file

    settings = dict(model=str(llama_dir), dtype="float32", group_size=2, prompts_per_iter=4, learning_rate=1e-2, max_new_tokens=8)
    settings.update(beta=0.1, updates_per_iter=2, micro_batch_tokens=64)  # a KL reference pass, old log-probs, several micro-batches
    out = {}
    for processes in (1, 2):
        config = RunConfig(**settings, train_processes=processes)
        run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / f"raw-{processes}")).run(
            one_step, config=config, base=Dir(path=str(llama_dir)), groups=6
        )
        folder, loss, world, kl = run.outputs()
        assert world == processes and (Path(folder) / "optimizer.pt").is_file()
        out[processes] = (load_file(str(Path(folder) / "adapter_model.safetensors")), loss, kl)
    (one, loss1, kl1), (two, loss2, kl2) = out[1], out[2]
    assert one.keys() == two.keys()
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-4
    assert any(float(one[k].abs().max()) > 0 for k in one if "lora_B" in k)  # the step moved the adapter
    assert loss2 == pytest.approx(loss1, abs=1e-5) and kl2 == pytest.approx(kl1, abs=1e-6)


# --------------------------------------------------------------------------- QLoRA (--load-in-4bit)


def _four_bit(llama_dir, **settings):
    config = RunConfig(model=str(llama_dir), dtype="float32", max_new_tokens=8, load_in_4bit=True, **settings)
    model = policy.peft_model(config.base, config.lora, str(llama_dir))
    policy.reset_lora(model, seed=0)
    return model, policy._optimizer(model, config.train), config


def test_a_4bit_step_trains_the_lora_weights_on_a_frozen_nf4_base(llama32_dir):
    llama_dir = llama32_dir
    import bitsandbytes as bnb

    model, optimizer, config = _four_bit(llama_dir, learning_rate=5e-2)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit) and q_proj.base_layer.weight.quant_state.quant_type == "nf4"
    assert q_proj.base_layer.weight.quant_state.nested  # double quantization
    ids = torch.tensor([A.prompt_ids + A.completion_ids])

    def base_logits():  # the base alone (the adapter disabled); NF4 weights are repacked on a CPU, so compare outputs
        with torch.no_grad(), model.disable_adapter():
            return model(input_ids=ids).logits

    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    base_before = base_logits()
    stats = policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling)
    assert stats.num_updates == 1
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    now = dict(model.named_parameters())
    # every target layer learned (B starts at 0), q/k/v included, whose gradient passes back through the 4-bit o_proj
    assert all(float(now[n].abs().max()) > 0 for n in lora if "lora_B" in n)
    assert torch.equal(base_logits(), base_before)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embeddings_in_4bit_hold_the_embedding_and_output_layer_in_nf4_and_still_train(tmp_path, tied):
    import bitsandbytes as bnb
    import transformers

    from grpo_flyte.models.loading import load_base

    path = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tied)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    ids = torch.tensor([A.prompt_ids + A.completion_ids])
    loaded = {}
    for embeddings in (False, True):
        base = load_base(str(path), "float32", load_in_4bit=True, embeddings_in_4bit=embeddings)
        with torch.no_grad():
            logits = base(input_ids=ids).logits
        size = sum(t.numel() * t.element_size() for t in base.parameters())
        loaded[embeddings] = base, logits, size
    (_, plain_logits, plain_size), (base, logits, size) = loaded.values()
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    assert isinstance(head, bnb.nn.Linear4bit) and head.weight.quant_state.quant_type == "nf4"
    assert embedding.weight.quant_state.quant_type == "nf4" and embedding.weight.quant_state.nested
    assert (head.weight is embedding.weight) == tied
    assert size < plain_size - 128 * 64 * (1 if tied else 2)  # at least a byte a weight saved
    # NF4 moves the logits a little, not the argmax of most positions
    assert not torch.equal(logits, plain_logits) and (logits.argmax(-1) == plain_logits.argmax(-1)).float().mean() > 0.5
    run = RunConfig(model=str(path), dtype="float32", max_new_tokens=8, load_in_4bit=True, embeddings_in_4bit=True, learning_rate=5e-2)
    model = policy.peft_model(run.base, run.lora, str(path))
    policy.reset_lora(model, seed=0)
    optimizer = policy._optimizer(model, run.train)
    policy_update.grpo_step(model, optimizer, [A, B], run.train, run.sampling)
    assert all(float(p.abs().max()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def test_the_kl_reference_of_a_4bit_run_is_the_4bit_base(llama32_dir):
    """The reference log-probs are the same NF4 weights with the adapter disabled (no 16-bit copy):
    equal to a 4-bit base loaded alone, and not to the 16-bit base."""
    from grpo_flyte.models.loading import load_base

    llama_dir = llama32_dir
    model, optimizer, config = _four_bit(llama_dir, learning_rate=5e-2, beta=0.1)
    policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling)  # the adapter is no longer the base
    ref, _ = policy_update._reference_pass(model, [A, B], [0, 1], set(), config.train, config.sampling, iteration=1)
    with torch.no_grad():
        expected = []
        for sixteen in (False, True):
            base = load_base(str(llama_dir), "float32", load_in_4bit=not sixteen)
            ids = torch.tensor([A.prompt_ids + A.completion_ids])
            logp = torch.log_softmax(base(input_ids=ids).logits[0].float() / config.sampling.temperature, dim=-1)
            p = len(A.prompt_ids)
            expected.append(torch.stack([logp[p - 1 + t, tok] for t, tok in enumerate(A.completion_ids)]))
    assert ref[0].tolist() == pytest.approx(expected[0].tolist(), abs=1e-5)
    assert float((ref[0] - expected[1]).abs().max()) > 1e-3


def test_merging_a_4bit_adapter_uses_the_16bit_base(tmp_path, llama32_dir):
    """--export-merged after a 4-bit run: the 16-bit base's weights plus the adapter's delta, never
    the dequantized NF4 weights."""
    from safetensors.torch import load_file

    llama_dir = llama32_dir
    model, optimizer, config = _four_bit(llama_dir, learning_rate=5e-2, lora_target_modules=("q_proj",))
    policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling)
    policy.save_adapter(model, optimizer, 1, tmp_path / "adapter")
    merge.merge_into_base(str(llama_dir), str(tmp_path / "adapter"), tmp_path / "merged")
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(llama_dir / "model.safetensors"))
    lora = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    a = next(v for k, v in lora.items() if "q_proj.lora_A" in k)
    b = next(v for k, v in lora.items() if "q_proj.lora_B" in k)
    key = "model.layers.0.self_attn.q_proj.weight"
    scale = config.lora.lora_alpha / config.lora.lora_rank
    assert merged[key].dtype == base[key].dtype and float((b @ a).abs().max()) > 0
    assert torch.allclose(merged[key], base[key] + scale * (b @ a), atol=1e-6)


@pytest.mark.parametrize("four_bit", [False, True], ids=["16-bit", "4-bit"])
def test_the_base_loads_straight_onto_the_device_not_whole_into_cpu_memory_first(llama32_dir, monkeypatch, four_bit):
    """Each process of a multi-GPU train step loads the base at once in one pod: transformers must
    place the weights on the process's device as it reads them (device_map), not build the whole
    model in CPU memory and move it (`.to(device)` after loading: a base copy per process in the
    pod's memory)."""
    import transformers

    from grpo_flyte.models.loading import load_base
    from grpo_flyte.runtime.device import best_device

    asked = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        asked.append(kwargs.get("device_map"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    moved = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    base = load_base(str(llama32_dir), "float32", load_in_4bit=four_bit)
    device = torch.cuda.current_device() if best_device() == "cuda" else "cpu"
    assert asked == [{"": device}] and moved == []
    assert {p.device.type for p in base.parameters()} == {best_device()}


def test_the_merge_loads_the_base_in_its_own_dtype_onto_the_device(tmp_path, llama32_dir, monkeypatch):
    """--export-merged on a bfloat16 base: the base loads once, in bfloat16 (a float32 copy was 12 GB
    for a 3B base, the whole train pod), straight onto the device; the merged weights are the
    base's plus the adapter's update, rounded to bfloat16 (within one bfloat16 step of the float32
    sum), and saved in bfloat16."""
    import transformers
    from safetensors.torch import load_file

    model, optimizer, config = _four_bit(llama32_dir, learning_rate=5e-2, lora_target_modules=("q_proj",))
    policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling)
    policy.save_adapter(model, optimizer, 1, tmp_path / "adapter")
    half = tmp_path / "base-bf16"
    transformers.AutoModelForCausalLM.from_pretrained(llama32_dir, dtype=torch.bfloat16).save_pretrained(half)
    transformers.AutoTokenizer.from_pretrained(llama32_dir).save_pretrained(half)
    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loads.append((kwargs.get("dtype"), kwargs.get("device_map")))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    merge.merge_into_base(str(half), str(tmp_path / "adapter"), tmp_path / "merged")
    from grpo_flyte.runtime.device import load_device

    assert loads == [(torch.bfloat16, {"": load_device()})]
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(half / "model.safetensors"))
    lora = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    a = next(v for k, v in lora.items() if "q_proj.lora_A" in k).float()
    b = next(v for k, v in lora.items() if "q_proj.lora_B" in k).float()
    key = "model.layers.0.self_attn.q_proj.weight"
    exact = base[key].float() + config.lora.lora_alpha / config.lora.lora_rank * (b @ a)
    assert merged[key].dtype == torch.bfloat16 and not torch.equal(merged[key], base[key])
    step = exact.abs() * 2**-7  # one bfloat16 step (8 significant bits) at each weight's size
    assert bool(((merged[key].float() - exact).abs() <= step).all())
    assert all(merged[k].dtype == torch.bfloat16 for k in merged)


def test_the_merge_task_frees_the_warm_training_model_first(tmp_path, llama32_dir, monkeypatch):
    """The merge shares the train replica's GPU with the run's cached training model and its
    optimizer: the task drops both before it loads the base again."""
    model, optimizer, _ = _four_bit(llama32_dir)
    policy.save_adapter(model, optimizer, 1, tmp_path / "adapter")
    trainer._warm.keep(model, str(tmp_path / "adapter"), optimizer, None)
    held = []
    monkeypatch.setattr(
        merge, "merge_into_base", lambda *args: held.append((policy._peft_model.cache_info().currsize, trainer._warm.model))
    )
    adapter = trainer.AdapterRef(version=1, dir=Dir(path=str(tmp_path / "adapter")))
    flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        trainer.merge_adapter, base_model=Dir(path=str(llama32_dir)), adapter=adapter
    )
    assert policy._peft_model.cache_info().currsize == 0 and held == [(0, None)]


def _rank_step(kwargs: dict):
    """One process of the cluster's train step (train_step_distributed without the upload)."""
    import asyncio

    return asyncio.run(data_parallel.rank_step(**kwargs))


def test_the_cluster_train_step_launched_as_the_elastic_plugin_launches_it_equals_the_local_step(tmp_path, llama_dir):
    """train_step_distributed's body under torch's elastic launcher, as flyteplugins-pytorch's
    Elastic runs it in a pod (2 processes, gloo here): rank 0 answers with the adapter of the
    one-process step, its world size, and the time it took to restore the adapter and optimizer
    state from the input folder (such a step has no warm replica)."""
    from uuid import uuid4

    from safetensors.torch import load_file
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = RunConfig(model=str(llama_dir), dtype="float32", group_size=2, prompts_per_iter=4, learning_rate=1e-2, max_new_tokens=8)
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        one_step, config=config, base=Dir(path=str(llama_dir)), groups=2
    )
    expected = load_file(str(Path(run.outputs()[0]) / "adapter_model.safetensors"))
    v0 = Path(run.outputs()[0]).parent / "v0000"
    kwargs = dict(model=config.base, lora=config.lora, train=config.train, sampling=config.sampling, base_model=Dir(path=str(llama_dir)),
                  adapter=trainer.AdapterRef(version=0, dir=Dir(path=str(v0))), scored=_scored_groups(), scored_payload=[],
                  total_iterations=1, out=tmp_path / "v0001")  # fmt: skip
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0)  # fmt: skip
    results = elastic_launch(launch, _rank_step)(kwargs)
    assert results[1] is None and results[0].adapter.version == 1
    stats = results[0].stats
    assert stats.world_size == 2 and stats.restore_s > 0
    got = load_file(str(tmp_path / "v0001" / "adapter_model.safetensors"))
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) <= 1e-4


def test_a_damaged_adapter_in_a_multi_process_step_is_the_adapter_error_not_retried(tmp_path, llama_dir):
    """A process's AdapterError comes back as the AdapterError (one line naming the folder, which
    the task does not retry), not as a crashed process."""
    from grpo_flyte.errors import AdapterError

    config = RunConfig(model=str(llama_dir), dtype="float32", max_new_tokens=8)
    (tmp_path / "v0000").mkdir()
    (tmp_path / "v0000" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    job = data_parallel.RankJob(str(llama_dir), str(tmp_path / "v0000"), config.base, config.lora, config.train, config.sampling,
                          [A, B], (0, 0), 1)  # fmt: skip
    with pytest.raises(AdapterError, match="v0000' cannot be loaded"):
        data_parallel.launch_ranks(job, tmp_path / "v0001", 2)


def test_the_train_side_keeps_a_loaded_base_per_base_model_and_drops_the_least_recently_used_past_the_bound(tmp_path, llama_dir, caplog):
    """A sweep over base models trains each on its own loaded base: calls that interleave the bases
    load each once; past MAX_BASES the least recently used is dropped (a process that ran other
    bases before), and coming back to it loads it again."""
    import shutil

    from grpo_flyte.config.constants import MAX_BASES

    bases = [str(shutil.copytree(llama_dir, tmp_path / f"base-{i}")) for i in range(MAX_BASES + 1)]
    config = RunConfig(dtype="float32")
    policy.release_models()

    def load(i: int):
        return policy.peft_model(config.base, config.lora, bases[i])

    def loads() -> list[str]:
        return [r.getMessage().split(" from ")[1].split(" ")[0] for r in caplog.records if "loading the base model" in r.getMessage()]

    with caplog.at_level("INFO", logger="grpo_flyte.learning.policy"):
        first = [load(i) for i in range(MAX_BASES)]
        assert all(load(i) is first[i] for i in (*range(MAX_BASES), *range(MAX_BASES)))  # interleaved: all warm
        assert loads() == bases[:MAX_BASES]
        load(MAX_BASES)  # base 0 was used least recently: dropped
        assert all(load(i) is first[i] for i in range(1, MAX_BASES)) and loads() == bases
        assert load(0) is not first[0] and loads() == [*bases, bases[0]]
    policy.release_models()


# --------------------------------------------------------------------------- the objective's options on a real step

_TYPE_SETTINGS = {
    "grpo": {},
    "dr_grpo": {},
    "dapo": {},
    "bnpo": {},
    "cispo": {"epsilon_high": 5.0},
    "sapo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "vespo": {},
}


@pytest.mark.parametrize("loss_type", list(_TYPE_SETTINGS))
def test_every_loss_type_trains_the_adapter(fresh, loss_type):
    model, optimizer, config = fresh(loss_type=loss_type, learning_rate=1e-2, **_TYPE_SETTINGS[loss_type])
    before = [p.detach().clone() for p in policy.trainable(model)]
    stats = policy_update.grpo_step(model, optimizer, [A, B], config.train, config.sampling)
    assert stats.num_updates == 1 and stats.grad_norm > 0 and math.isfinite(stats.loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.trainable(model), strict=True))
    assert (stats.vespo_phi_mean is not None) == (loss_type == "vespo")


def test_num_iterations_takes_its_passes_each_against_the_old_policy(fresh, monkeypatch):
    """num_iterations=2 with 2 updates per pass: 4 optimizer steps, at the schedule's steps 4..7 of
    iteration 2 of 2; every minibatch of the second pass measures its ratio against the log-probs
    from before the first step (computed up front), so its log-ratio is no longer 0."""
    needed, log_ratios = _spy_old_logprobs(monkeypatch)
    seen = []
    sequences = [A, B, TrainSequence(A.prompt_ids, [18, 2], 0.5), TrainSequence(B.prompt_ids, [19, 20, 2], -0.5)]
    model, optimizer, config = fresh(train={"num_iterations": 2}, updates_per_iter=2, learning_rate=5e-2, lr_scheduler_type="linear")
    step = optimizer.step
    monkeypatch.setattr(optimizer, "step", lambda *a, **k: seen.append(optimizer.param_groups[0]["lr"]) or step(*a, **k))
    assert config.train.steps_per_iteration == 4
    stats = policy_update.grpo_step(model, optimizer, sequences, config.train, config.sampling, steps=(4, 8))
    assert stats.num_updates == 4 and seen == pytest.approx([5e-2 * (8 - s) / 8 for s in (4, 5, 6, 7)])
    assert needed == [{0, 1, 2, 3}]  # the second pass needs minibatch 0's old log-probs too
    assert torch.equal(log_ratios[0], torch.zeros_like(log_ratios[0]))  # pass 1, minibatch 0: the current policy
    assert all(r.abs().max() > 0 for r in log_ratios[1:])
    one = _step(fresh, sequences, updates_per_iter=2, learning_rate=5e-2)
    assert one.num_updates == 2


def test_the_train_task_counts_num_iterations_in_the_schedule_and_keeps_the_adaptive_coefficient(tmp_path, llama_dir):
    """Two train_steps with num_iterations=2: each takes 2 x updates_per_iter optimizer steps; the
    adaptive entropy coefficient one step ends with is saved in the adapter folder and the next
    step, with no warm state, starts from it."""
    import json

    from grpo_flyte.types import STATE_FILE

    config = RunConfig(
        model=str(llama_dir), dtype="float32", group_size=2, max_new_tokens=8, learning_rate=1e-2,
        train={"num_iterations": 2, "use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 100.0,
               "entropy_coef_delta": 0.01},
    )  # fmt: skip
    run = flyte.with_runcontext(mode="local", raw_data_path=str(tmp_path / "raw")).run(
        adaptive_steps, config=config, base=Dir(path=str(llama_dir))
    )
    (first, second), folders = run.outputs()
    assert first.stats.num_updates == 2 and second.stats.num_updates == 2  # 1 update per pass, 2 passes
    # the entropy (about ln 64 nats) is below the target: +0.01 per optimizer step, and it carries over
    assert first.stats.entropy_coef == pytest.approx(0.12) and second.stats.entropy_coef == pytest.approx(0.14)
    state = json.loads((Path(folders[0]) / STATE_FILE).read_text())
    assert state["entropy_coef"] == pytest.approx(0.12) and state["last_entropy"] > 0
    assert policy.entropy_control(folders[0], config.train).coef == pytest.approx(0.12)
    assert policy.entropy_control(folders[0], config.train.model_copy(update={"use_adaptive_entropy": False})).coef == 0.1


@warm_env.task
async def adaptive_steps(config: RunConfig, base: Dir) -> tuple[list, list[str]]:
    """init_adapter, then two cold train_steps (the warm optimizer forgotten between them)."""
    adapter = await trainer.init_adapter(config.base, config.lora, config.seed, base)
    results, folders = [], []
    for _ in range(2):
        trainer._warm.clear()
        result = await trainer.train_step(config.base, config.lora, config.train, config.sampling, base, adapter, _scored_groups())
        adapter = result.adapter
        results.append(result)
        folders.append(adapter.dir.path)
    return results, folders


def test_micro_batches_of_the_cpu_budget_give_the_step_of_one_micro_batch(fresh):
    """The CPU's token budget (512 when micro_batch_tokens is unset) cuts a step into more
    micro-batches: memory, not the result. Here 64-token micro-batches (one sequence each) against
    one of 4096: the same loss, gradient norm and new weights, to float rounding."""
    rows = [
        TrainSequence(prompt_ids=[1, *range(3, 3 + n)], completion_ids=[*range(20, 20 + k), 2], advantage=a)
        for n, k, a in ((30, 9, 1.0), (26, 12, -1.0), (33, 5, 0.5), (20, 20, -0.5))
    ]

    def step(tokens: int):
        model, optimizer, config = fresh(micro_batch_tokens=tokens)
        budget = config.train.token_budget("cpu")
        stats = policy_update.grpo_step(model, optimizer, rows, config.train, config.sampling)
        plan = grpo.plan_micro_batches([s.length for s in rows], budget)
        return stats, len(plan), torch.cat([p.detach().flatten() for p in policy.trainable(model)])

    small, small_batches, small_weights = step(64)
    one, one_batches, one_weights = step(4096)
    assert (small_batches, one_batches) == (4, 1)
    assert small.loss == pytest.approx(one.loss, abs=1e-7)
    assert small.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    assert torch.allclose(small_weights, one_weights, atol=1e-7)
    untrained = torch.cat([p.detach().flatten() for p in policy.trainable(fresh()[0])])
    assert not torch.allclose(one_weights, untrained, atol=1e-6)  # the step moved them
