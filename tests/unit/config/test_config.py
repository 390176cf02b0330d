"""Unit tests for RunConfig, make_config and load_config_file."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import ValidationError

from grpo_flyte.config.errors import make_config
from grpo_flyte.config.files import flatten, load_config_file
from grpo_flyte.config.run import RunConfig, leaf_fields
from grpo_flyte.errors import ConfigError, flag


def test_defaults_are_valid():
    config = make_config()
    assert config == RunConfig()
    assert config.flat()["model"] == "embedded"
    assert config.flat()["dataset"] == "arithmetic"
    assert config.flat()["group_size"] >= 2
    # derived values: prompts_per_iter * group_size
    assert config.rollouts_per_iter == config.prompts_per_iter * config.flat()["group_size"]
    assert config.base.dtype == "auto"  # resolved where the task runs: models.resolve_dtype


def test_auto_dtype_is_bfloat16_only_where_bfloat16_matmuls_are_fast(monkeypatch):
    import torch

    from grpo_flyte.runtime import device

    monkeypatch.setattr(device, "_cuda_usable", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # e.g. an AVX2-only CPU
    assert device.resolve_dtype("auto") == "float32"
    assert device.torch_dtype("auto") is torch.float32
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # AVX-512 / AMX
    assert device.resolve_dtype("auto") == "bfloat16"
    monkeypatch.setattr(device, "_cuda_usable", lambda: True)
    monkeypatch.setattr(device, "_compute_capability", lambda: (7, 5))  # e.g. a T4 (tests/unit/runtime/test_device.py: read from NVML)
    assert device.resolve_dtype("auto") == "float32"
    assert (device.resolve_dtype("float32"), device.resolve_dtype("bfloat16")) == ("float32", "bfloat16")


def test_make_config_sets_fields():
    config = make_config(group_size=3, prompts_per_iter=5, temperature=0.7, dataset="data/train.jsonl")
    assert (config.flat()["group_size"], config.prompts_per_iter, config.flat()["temperature"]) == (3, 5, 0.7)
    assert config.rollouts_per_iter == 15  # 5 prompts x 3 completions
    assert config.flat()["dataset"] == "data/train.jsonl"


def test_group_size_1_names_flag_and_value():
    with pytest.raises(ConfigError) as exc:
        make_config(group_size=1)
    msg = str(exc.value)
    assert "--group-size" in msg
    assert re.search(r"--group-size\W+1\b", msg), msg
    assert "\n" not in msg


def test_unknown_field_is_named():
    with pytest.raises(ConfigError) as exc:
        make_config(bogus_option=3)
    assert "--bogus-option" in str(exc.value)
    assert "unknown" in str(exc.value)


@pytest.mark.parametrize("value", [0, 0.0, -1.0])
def test_temperature_must_be_positive(value):
    with pytest.raises(ConfigError, match="--temperature"):
        make_config(temperature=value)


def test_several_problems_in_one_message():
    with pytest.raises(ConfigError) as exc:
        make_config(group_size=1, lora_rank=0)
    assert "--group-size" in str(exc.value) and "--lora-rank" in str(exc.value)


@pytest.mark.parametrize("dataset", ["foo.tsv", "data.json", "rows.txt"])
def test_dataset_must_be_a_known_name_or_file_type(dataset):
    with pytest.raises(ConfigError) as exc:
        make_config(dataset=dataset)
    msg = str(exc.value)
    # the message names the value and says what is accepted
    assert f"dataset={dataset!r}" in msg
    assert "arithmetic" in msg and "gsm8k" in msg and ".jsonl, .parquet, .csv" in msg


@pytest.mark.parametrize("field", ["prompt_format", "dtype", "backend"])
def test_literal_fields_reject_other_values(field):
    with pytest.raises(ConfigError, match=flag(field)):
        make_config(**{field: "nonsense"})


def test_flag_name():
    assert flag("max_new_tokens") == "--max-new-tokens"


def test_run_config_is_frozen():
    config = RunConfig()
    with pytest.raises(ValidationError):
        config.sampling.group_size = 8
    with pytest.raises(ValidationError):
        config.seed = 8
    assert config.sampling.group_size == RunConfig().sampling.group_size
    assert hash(config) == hash(RunConfig())  # frozen models are hashable


def test_run_config_json_round_trip():
    config = make_config(seed=7, lora_target_modules=["q_proj", "v_proj"])
    assert config.flat()["lora_target_modules"] == ("q_proj", "v_proj")
    assert RunConfig.model_validate_json(config.model_dump_json()) == config


# --------------------------------------------------------------------------- load_config_file


def test_load_yaml(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("group_size: 3\ntemperature: 0.5\nlora_target_modules: [q_proj]\n")
    data = load_config_file(p)
    assert data == {"group_size": 3, "temperature": 0.5, "lora_target_modules": ["q_proj"]}
    assert make_config(**data).lora.lora_target_modules == ("q_proj",)


def test_load_json(tmp_path):
    p = tmp_path / "run.json"
    p.write_text('{"seed": 11, "model": "/models/x"}')
    assert load_config_file(str(p)) == {"seed": 11, "model": "/models/x"}


def test_load_empty_yaml_is_empty_mapping(tmp_path):
    p = tmp_path / "empty.yml"
    p.write_text("")
    assert load_config_file(p) == {}


@pytest.mark.parametrize(
    ("name", "text", "what"),
    [
        ("list.yaml", "- group_size\n- 3\n", "mapping"),
        ("list.json", "[1, 2]", "mapping"),
        ("scalar.yaml", "just a string\n", "mapping"),
        ("bad.yaml", "group_size: [3\n", "not valid yaml"),
        ("bad.json", '{"seed": 1,}', "not valid json"),
    ],
)
def test_load_bad_files_name_the_file(tmp_path, name, text, what):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config_file(p)
    assert str(p) in str(exc.value)
    assert what in str(exc.value)


@pytest.mark.parametrize(("name", "text"), [("bad.yaml", "group_size: [3\n"), ("bad.json", '{"seed": 1,}')])
def test_invalid_file_message_is_one_line(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config_file(p)
    assert "\n" not in str(exc.value)


def test_load_missing_file_names_it(tmp_path):
    p = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as exc:
        load_config_file(p)
    assert str(p) in str(exc.value)
    assert "no such file" in str(exc.value)


def test_load_directory_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config_file(tmp_path)


def test_load_not_utf8_is_a_config_error(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"model: caf\xe9\n")
    with pytest.raises(ConfigError) as exc:
        load_config_file(p)
    assert str(p) in str(exc.value)


@pytest.mark.parametrize("field", ["loss_type", "truncated"])
def test_objective_literals_reject_other_values(field):
    with pytest.raises(ConfigError, match=flag(field)):
        make_config(**{field: "nonsense"})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epsilon", 0.0),
        ("epsilon", 1.0),
        ("epsilon_high", 0.0),
        ("updates_per_iter", 0),
        ("beta", -0.1),
        ("is_cap", 0.5),
        ("eval_size", -1),
        ("eval_every", -1),
        ("min_informative_groups", -1),
    ],
)
def test_objective_bounds_name_flag_and_value(field, value):
    with pytest.raises(ConfigError) as info:
        make_config(**{field: value})
    assert f"{flag(field)}={value!r}" in str(info.value)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_files_are_valid(path):
    config = make_config(**load_config_file(path))
    assert config != RunConfig()  # each example sets something


# --------------------------------------------------------------------------- every field's invalid values


def _invalid_values(name: str) -> list:
    """Values of the wrong type for every field, plus each bound, pattern or choice crossed."""
    import annotated_types

    field = dict(leaf_fields())[name]
    # no field takes a list (the one tuple field takes strings only)
    values: list = [[1, 2] if field.annotation == tuple[str, ...] else ["a", "list"]]
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge):
            values.append(bound.ge - 1)
        elif isinstance(bound, annotated_types.Gt):
            values.append(bound.gt)
        elif isinstance(bound, annotated_types.Le):
            values.append(bound.le + 1)
        elif isinstance(bound, annotated_types.Lt):
            values.append(bound.lt)
        elif isinstance(bound, annotated_types.MinLen):
            values.append(() if field.annotation == tuple[str, ...] else "")
    default = field.get_default(call_default_factory=True)
    if getattr(field.annotation, "__origin__", None) is Literal:
        values.append("nonsense")
    elif isinstance(default, bool):
        values.append("maybe")
    elif isinstance(default, (int, float)):
        values.append("abc")
    elif isinstance(default, dict):
        values += [{}, {"no such reward": 1.0}, {"correct": "high"}]
    return values


CUSTOM_CHECKS = {
    "dataset": ["data.json", "rows.tsv"],
    "model": [],
    "env": ["calc", "my_env.Class", "a:b:c"],
    "agent": ["rollout", "my_agent.rollout", "a:b:c"],
    "push_to_hub": ["no-slash", "a/b/c"],
    "judge_rubric": ["no-such-rubric.txt", "rubrics/missing.md"],
    "generation_kwargs": [{"temperature": 1.0}, {"no_such_key": 1}],
    "chat_template_kwargs": [{"tokenize": False}],
    "report_to": ["comet", "all", "wandb,nope", "none,wandb"],
    "tools": ["no_colon", "a:b:c", "tests.support.tool_fns:add,nope"],
    "export_adapter": ["latest", "BEST"],
    "export_gguf": ["q4_k_m", "F16"],
}


@pytest.mark.parametrize("name", [name for name, _ in leaf_fields()])
def test_every_field_rejects_its_invalid_values_naming_flag_and_value(name):
    values = _invalid_values(name) + CUSTOM_CHECKS.get(name, [])
    assert len(values) >= 2 or name in ("system_prompt", "answer_instruction", "wandb_project", "model"), (
        f"{name}: add its invalid values to this matrix"
    )
    for value in values:
        with pytest.raises(ConfigError) as info:
            make_config(**{name: value})
        message = str(info.value)
        assert flag(name) in message, (name, value, message)
        assert "\n" not in message


# --------------------------------------------------------------------------- parts: flat and nested


def test_flat_and_nested_construction_give_equal_configs():
    flat = RunConfig(group_size=4, lora_rank=8, learning_rate=0.01, dataset="d.jsonl", seed=3)
    nested = RunConfig(
        sampling={"group_size": 4}, lora={"lora_rank": 8}, train={"learning_rate": 0.01}, data={"dataset": "d.jsonl"}, seed=3
    )
    assert flat == nested
    assert hash(flat) == hash(nested)
    assert (flat.sampling.group_size, flat.lora.lora_rank, flat.train.learning_rate) == (4, 8, 0.01)
    assert flat.data.dataset == "d.jsonl"
    # the fields not given keep their defaults in both forms
    assert flat.sampling.temperature == RunConfig().sampling.temperature
    assert flat.flat() == {**RunConfig().flat(), "group_size": 4, "lora_rank": 8, "learning_rate": 0.01, "dataset": "d.jsonl", "seed": 3}
    assert make_config(group_size=4, lora_rank=8) == make_config(sampling={"group_size": 4}, lora={"lora_rank": 8})
    # the nested dump (a run's config.json) loads back, from JSON and through flatten()
    assert RunConfig.model_validate_json(flat.model_dump_json()) == flat
    assert make_config(**flatten(flat.model_dump())) == flat


def test_flat_yaml_nested_yaml_and_flags_set_the_same_nested_field(tmp_path):
    from grpo_flyte.launch.cli import parse_args

    flat_file = tmp_path / "flat.yaml"
    flat_file.write_text("group_size: 4\nlearning_rate: 0.01\n")
    nested_file = tmp_path / "nested.yaml"
    nested_file.write_text("sampling:\n  group_size: 4\ntrain:\n  learning_rate: 0.01\n")
    nested_json = tmp_path / "nested.json"
    nested_json.write_text('{"sampling": {"group_size": 4}, "train": {"learning_rate": 0.01}}')
    assert load_config_file(flat_file) == load_config_file(nested_file) == {"group_size": 4, "learning_rate": 0.01}

    configs = [
        parse_args(["--config", str(flat_file)])[1],
        parse_args(["--config", str(nested_file)])[1],
        parse_args(["--config", str(nested_json)])[1],
        parse_args(["--group-size", "4", "--learning-rate", "0.01"])[1],
    ]
    for config in configs:
        assert config.sampling.group_size == 4
        assert config.train.learning_rate == 0.01
        assert config == configs[0]
    assert configs[0] != RunConfig()
    # a flag overrides the nested file's value of the same field
    _, config, explicit = parse_args(["--config", str(nested_file), "--group-size", "6"])
    assert (config.sampling.group_size, config.train.learning_rate) == (6, 0.01)
    assert explicit == {"group_size", "learning_rate"}  # the flag, and the file's nested field


def test_validation_error_inside_a_part_names_the_flag():
    for values in ({"group_size": 1}, {"sampling": {"group_size": 1}}):
        with pytest.raises(ConfigError) as info:
            make_config(**values)
        message = str(info.value)
        assert message.startswith("--group-size=1"), message
        assert "sampling" not in message  # the part is how the config is stored, not what the user typed
        assert "\n" not in message
    with pytest.raises(ConfigError) as info:
        make_config(train={"learning_rate": 0.0}, evaluation={"eval_size": -1})
    assert "--learning-rate=0.0" in str(info.value) and "--eval-size=-1" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_config(sampling={"bogus_option": 1})
    assert str(info.value).startswith("--bogus-option") and "unknown" in str(info.value)


def test_validation_error_in_a_nested_config_file_names_the_flag(tmp_path):
    from grpo_flyte.launch.cli import parse_args

    p = tmp_path / "nested.yaml"
    p.write_text("sampling:\n  group_size: 1\n")
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(p)])
    assert str(info.value).startswith("--group-size=1"), str(info.value)


# --------------------------------------------------------------------------- scale_rewards vs loss_type


def _scored_group(rewards: list[float]):
    from grpo_flyte.types import Example, RewardParts, Rollout, RolloutGroup, ScoredGroup

    rollouts = [
        Rollout(completion_ids=[10 + i, 20 + i], sampling_logprobs=[-0.5, -0.25], finish_reason="stop", text=f"c{i}")
        for i in range(len(rewards))
    ]
    group = RolloutGroup(
        index=0,
        example=Example(question="What is 1 + 2?", answer="3"),
        adapter_version=0,
        prompt_ids=[1, 2, 3],
        rollouts=rollouts,
        generate_s=0.0,
    )
    parts = [RewardParts(reward=r, correct=r >= 1, format=True) for r in rewards]
    return ScoredGroup(group=group, rewards=parts)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_scale_rewards_is_independent_of_loss_type(loss_type):
    from grpo_flyte.learning.update import build_sequences

    scored = [_scored_group([0.0, 1.0, 1.0, 3.0])]
    # by hand: mean = 5/4 = 1.25; centred = -1.25, -0.25, -0.25, 1.75;
    # sample variance (the default) = (1.5625 + 0.0625 + 0.0625 + 3.0625) / 3 = 1.58333
    centred = [-1.25, -0.25, -0.25, 1.75]
    eps = 1e-3
    std = math.sqrt(4.75 / 3)
    expected = {"group": [c / (std + eps) for c in centred], "none": centred}
    # the default does not depend on the loss either: dr_grpo no longer implies 'none'
    assert make_config(loss_type=loss_type).train.scale_rewards == "group"
    for scale_rewards, want in expected.items():
        config = make_config(loss_type=loss_type, scale_rewards=scale_rewards, truncated="keep", advantage_eps=eps)
        sequences, total = build_sequences(scored, config.train)
        assert total == 4
        assert [s.advantage for s in sequences] == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert [s.completion_ids for s in sequences] == [r.completion_ids for r in scored[0].group.rollouts]
        assert all(s.prompt_ids == [1, 2, 3] for s in sequences)


def test_scale_rewards_takes_trls_values_and_rejects_others():
    assert [make_config(scale_rewards=v).train.scale_rewards for v in ("batch", True, False)] == ["batch", "group", "none"]
    with pytest.raises(ConfigError) as info:
        make_config(scale_rewards="global")
    assert str(info.value).startswith("--scale-rewards='global'"), str(info.value)


# --------------------------------------------------------------------------- parts as task inputs


def test_an_unrelated_field_leaves_the_other_parts_unchanged():
    before = make_config()
    after = make_config(learning_rate=before.train.learning_rate / 2)
    assert after != before
    assert after.train != before.train and hash(after.train) != hash(before.train)
    assert after.train.learning_rate == before.train.learning_rate / 2
    for part in ("sampling", "prompt", "scoring", "base", "engine", "data", "lora", "evaluation"):
        old, new = getattr(before, part), getattr(after, part)
        assert new == old, part
        assert hash(new) == hash(old), part
        assert new.model_dump_json() == old.model_dump_json(), part  # what a task's cache key is built from


@pytest.mark.parametrize("change", [{"load_in_4bit": True}, {"load_in_4bit": True, "embeddings_in_4bit": True}, {"train_processes": 2}])
def test_the_bigger_model_flags_leave_generates_inputs_unchanged(change):
    """--load-in-4bit and --train-processes are the train pool's: generate's parts (and so its
    Flyte cache key) stay the same; the generate pool keeps the 16-bit base."""
    from grpo_flyte.loop.batches import generate_parts

    before, after = make_config(), make_config(**change)
    old, new = generate_parts(before), generate_parts(after)
    assert {k: v.model_dump_json() for k, v in new.items()} == {k: v.model_dump_json() for k, v in old.items()}
    assert (after.lora, after.train) != (before.lora, before.train)


def test_embeddings_in_4bit_needs_the_4bit_base():
    with pytest.raises(ConfigError, match=r"^--embeddings-in-4bit needs --load-in-4bit: the rest of the base in 4 bits$"):
        make_config(embeddings_in_4bit=True)
    assert make_config(load_in_4bit=True, embeddings_in_4bit=True).lora.embeddings_in_4bit


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    # nine levels of ten: 10^9 strings once expanded, from a few hundred bytes
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    lines.append("rewards: *a8")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"expands to \d{10} values \(YAML aliases\); expected at most 100000") as info:
        load_config_file(bomb)
    assert len(str(info.value)) < 300
    huge = tmp_path / "huge.yaml"
    huge.write_text("seed: 1\n" + "#" * 1_000_001 + "\n")
    with pytest.raises(ConfigError, match="expected a config file under 1000000 bytes"):
        load_config_file(huge)


def test_a_huge_bad_value_is_cut_in_the_message():
    with pytest.raises(ConfigError) as info:
        make_config(seed=["x" * 10] * 100_000)
    message = str(info.value)
    assert "--seed=['xxxxxxxxxx'" in message and "characters)" in message and len(message) < 600


def test_a_field_under_the_wrong_part_names_its_part(tmp_path):
    # in a file: 'sampling: {learning_rate: ...}' was lifted silently before
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("sampling:\n  group_size: 4\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"'sampling.learning_rate': learning_rate belongs to the 'train' part, not 'sampling'"):
        load_config_file(wrong)
    loop = tmp_path / "loop.yaml"
    loop.write_text("train:\n  seed: 3\n")
    with pytest.raises(ConfigError, match=r"seed belongs to the top level \(a loop field\), not 'train'"):
        load_config_file(loop)
    # from Python: was "unknown option", which is wrong for a field that exists
    with pytest.raises(ConfigError, match=r"--learning-rate: 'sampling.learning_rate': learning_rate belongs to the 'train' part"):
        make_config(sampling={"learning_rate": 0.1})
    with pytest.raises(ConfigError, match=r"--bogus: unknown option"):
        make_config(sampling={"bogus": 1})
    # the right part, nested or flat, still works
    right = tmp_path / "right.yaml"
    right.write_text("sampling:\n  group_size: 4\ntrain:\n  learning_rate: 0.1\n")
    assert make_config(**load_config_file(right)).train.learning_rate == 0.1


# --------------------------------------------------------------------------- TRL's names


def test_trl_names_set_the_same_options():
    config = make_config(
        num_generations=4, max_completion_length=32, max_prompt_length=300, lora_r=8, model_name_or_path="embedded",
        mask_truncated_completions=True, scale_rewards=False, vllm_importance_sampling_cap=3.0,
        reward_funcs=["correct", "tags"], reward_weights=[1.0, 0.5],
    )  # fmt: skip
    flat = config.flat()
    assert (flat["group_size"], flat["max_new_tokens"], flat["max_prompt_tokens"], flat["lora_rank"]) == (4, 32, 300, 8)
    assert (flat["truncated"], flat["scale_rewards"], flat["is_cap"]) == ("mask", "none", 3.0)
    assert flat["rewards"] == {"correct": 1.0, "tags": 0.5}
    assert make_config(mask_truncated_completions=False).train.truncated == "keep"
    assert make_config(reward_weights=[2.0]).scoring.rewards == {"correct": 2.0}  # the default rewards, in order


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"num_generations": 4, "group_size": 6}, "num_generations (TRL's name for group_size) is 4 but group_size is 6; give one of them"),
        ({"reward_funcs": ["correct", "format"], "reward_weights": [1.0]}, "reward_weights has 1 weights for 2 rewards (correct, format)"),
        ({"mask_truncated_completions": "yes"}, "mask_truncated_completions='yes': expected true or false"),
    ],
)
def test_trl_names_that_cannot_be_honoured_are_refused(values, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_config(**values)


def test_a_trl_style_config_file(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("num_generations: 6\nmax_completion_length: 48\nlearning_rate: 1.0e-5\nbeta: 0.04\nloss_type: dr_grpo\n")
    flat = make_config(**load_config_file(path)).flat()
    assert (flat["group_size"], flat["max_new_tokens"], flat["learning_rate"], flat["beta"], flat["loss_type"]) == (
        6,
        48,
        1e-5,
        0.04,
        "dr_grpo",
    )
    path.write_text("num_generations: 6\nnum_iterations: 2\nuse_vllm: true\nvllm_gpu_memory_utilization: 0.3\n")
    config = make_config(**load_config_file(path))  # num_iterations: TRL's mu, not the loop's length
    assert (config.train.num_iterations, config.iterations, config.engine.backend, config.engine.vllm_memory_fraction) == (
        2,
        10,
        "vllm",
        0.3,
    )


# --------------------------------------------------------------------------- sampling rules and generation_kwargs


def test_the_sampling_rules_default_off_and_reach_each_request():
    from grpo_flyte.engine.interface import sampling_request

    default = RunConfig().sampling
    assert (default.top_k, default.min_p, default.repetition_penalty, default.generation_kwargs) == (0, None, 1.0, None)
    assert default.generation_options == {}
    config = RunConfig(top_k=40, min_p=0.05, repetition_penalty=1.1, generation_kwargs={"stop": "</answer>", "stop_token_ids": [7]})
    request = sampling_request(config.sampling, [1, 2], seed=3)
    assert (request.top_k, request.min_p, request.repetition_penalty) == (40, 0.05, 1.1)
    assert (request.stop, request.stop_token_ids) == (("</answer>",), (7,))  # a single stop string becomes a list of one
    assert request.sampling().rules.truncates and request.sampling().rules.penalizes
    assert not sampling_request(default, [1, 2], seed=3).sampling().rules.truncates


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.3}, "key 'temperature': set it with its own option, --temperature"),
        ({"n": 4}, "key 'n': set it with its own option, --group-size"),
        ({"logprobs": 5}, "key 'logprobs': set it with its own option, none: the sampled tokens' log-probs are always returned"),
        ({"presence_penalty": 0.5}, "key 'presence_penalty' is not supported: it changes the distribution tokens are drawn from"),
        ({"num_beams": 4}, "key 'num_beams' is not supported"),
        ({"frobnicate": 1}, "key 'frobnicate' is unknown or not supported; supported keys: stop, stop_token_ids"),
        ({"stop": [3]}, "key 'stop': [3]; expected a list of strings"),
        ({"stop_token_ids": ["a"]}, "key 'stop_token_ids': ['a']; expected a list of token ids"),
        ({"stop_token_ids": [-1]}, "expected token ids >= 0"),
    ],
)
def test_generation_kwargs_that_the_trainer_could_not_follow_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        RunConfig(generation_kwargs=kwargs)


@pytest.mark.parametrize(("field", "value"), [("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0)])
def test_out_of_range_sampling_rules_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        RunConfig(**{field: value})


def test_epsilon_high_unset_is_epsilon_as_in_trl():
    assert make_config().train.epsilon_high == 0.2
    assert make_config(epsilon=0.3).train.epsilon_high == 0.3  # TRL: epsilon_high None -> epsilon
    assert make_config(epsilon=0.3, epsilon_high=None).train.epsilon_high == 0.3
    assert make_config(epsilon=0.3, epsilon_high=0.28).train.epsilon_high == 0.28


def test_an_unset_micro_batch_budget_is_4096_tokens_on_a_gpu_and_512_on_a_cpu():
    from grpo_flyte.config.training import TrainConfig

    unset = TrainConfig()
    assert unset.micro_batch_tokens is None
    assert (unset.token_budget("cuda"), unset.token_budget("cpu")) == (4096, 512)
    assert TrainConfig(micro_batch_tokens=2048).token_budget("cpu") == 2048  # a setting wins on either
    assert RunConfig.model_validate({"micro_batch_tokens": 1024}).train.token_budget("cuda") == 1024
