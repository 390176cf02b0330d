"""A sweep's configs: flags and config-file sections expanded into checked configs, and every
grid error found before anything starts, in one line naming --sweep and the bad value."""

from __future__ import annotations

import pytest

from grpo_flyte.config.grid import expand_sweep, member_name, sweep_grid
from grpo_flyte.errors import ConfigError, UserError
from grpo_flyte.launch.cli import parse_args, user_message


def test_a_grid_is_every_combination_in_flag_order_each_config_whole():
    members = expand_sweep({"iterations": 3}, sweep_grid(["learning_rate=1e-4,2e-4", "seed=0,1,2"]))
    assert [m.name for m in members] == [f"learning_rate={lr}_seed={s}" for lr in ("1e-4", "2e-4") for s in (0, 1, 2)]
    assert [(m.config.train.learning_rate, m.config.seed) for m in members] == [(lr, s) for lr in (1e-4, 2e-4) for s in (0, 1, 2)]
    assert all(m.config.iterations == 3 for m in members)  # the rest of the config is the flags'
    assert members[0].overrides == {"learning_rate": 1e-4, "seed": 0}  # typed, as the config holds them


def test_a_config_files_section_is_a_grid_or_a_list_and_trl_names_work():
    grid = expand_sweep({}, sweep_grid([], {"num_generations": [4, 8]}))
    assert [m.config.sampling.group_size for m in grid] == [4, 8]
    listed = expand_sweep({}, sweep_grid([], [{"seed": 1}, {"seed": 2, "learning_rate": 1e-3}]))
    assert [(m.name, m.config.seed, m.config.train.learning_rate) for m in listed] == [
        ("seed=1", 1, 2e-4),
        ("seed=2_learning_rate=0.001", 2, 1e-3),
    ]


def test_values_with_commas_are_split_on_semicolons():
    members = expand_sweep({}, sweep_grid(["rewards=correct=1;correct=1,format=0.1"]))
    assert [m.config.scoring.rewards for m in members] == [{"correct": 1.0}, {"correct": 1.0, "format": 0.1}]
    assert member_name({"rewards": {"correct": 1.0, "format": 0.1}}) == "rewards=correct=1.0-format=0.1"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["learning_rate=1e-4,abc"], "--sweep learning_rate=abc: --learning-rate='abc': Input should be a valid number"),
        (["lerning_rate=1e-4"], "--sweep 'lerning_rate': unknown option; did you mean 'learning_rate'?"),
        (["learning_rate"], "--sweep 'learning_rate': expected KEY=VALUE1,VALUE2"),
        (["seed=1,,2"], "--sweep 'seed=1,,2': an empty value"),
        (["seed=0,1", "seed=2"], "--sweep 'seed=2': seed is swept twice"),
        (["group_size=2,1"], "--sweep group_size=1: --group-size='1': Input should be greater than or equal to 2"),
        (["backend=hf,vllm"], "--sweep backend=hf,vllm: changes the generate engine, which every config of a sweep shares"),
        (
            ["model=a,b,c,d"],
            "--sweep model=a,b,c,d: 4 base models, each its own engine and loaded base on every replica; expected at most 3",
        ),
        (["model=a,b", "dtype=bfloat16,float32"], "--sweep model=a,b dtype=bfloat16,float32: 4 base models"),
        (["lora_rank=8,16"], "--sweep lora_rank=8,16: changes the train pool's loaded base (its LoRA layers)"),
        (["reward_workers=2,8"], "--sweep reward_workers=2,8: changes the reward pool's workers, which every config of a sweep shares"),
        (["rewards=correct"], "--sweep rewards=correct: expected NAME=WEIGHT"),
    ],
)
def test_grid_errors_name_the_flag_and_the_value(flags, expected):
    with pytest.raises(ConfigError) as err:
        expand_sweep({}, sweep_grid(flags))
    assert user_message(err.value).startswith(expected)
    assert "\n" not in user_message(err.value)


def test_a_key_that_would_split_the_vllm_engine_is_refused_unless_on_transformers():
    with pytest.raises(ConfigError, match="vLLM engine's context length"):
        expand_sweep({"backend": "vllm"}, sweep_grid(["max_new_tokens=32,64"]))
    with pytest.raises(ConfigError, match="vLLM engine's context length"):
        expand_sweep({}, sweep_grid(["max_new_tokens=32,64"]), local=False)  # auto is vLLM on a GPU pod
    assert len(expand_sweep({"backend": "hf"}, sweep_grid(["max_new_tokens=32,64"]), local=False)) == 2
    # one value changes nothing: not a split
    assert len(expand_sweep({}, sweep_grid(["model=a", "seed=1,2"]))) == 2


def test_keys_that_change_an_engines_context_are_refused_on_vllm_naming_the_key_and_what_to_do():
    """The generate engine's max_model_len is max_prompt_tokens + max_new_tokens, or with a multi-turn
    environment max_prompt_tokens + max_episode_tokens: `env` between 'none' and an environment
    changes it (512 + 64 = 576 against 512 + 384 = 896), and judge_context_tokens is the judge
    engine's. A replica keeps one engine per base (the judge's pool one), so each switch between
    such configs would rebuild it: refused in one line, unless on transformers (no max_model_len)."""
    with pytest.raises(ConfigError) as err:
        expand_sweep({}, sweep_grid(["env=none,calculator"]), local=False)  # auto is vLLM on a GPU pod
    assert user_message(err.value) == (
        "--sweep env=none,calculator: changes the vLLM engine's context length (max_model_len 576, 896), which the configs of a "
        "base model share: it would be rebuilt at every switch between them; expected one sweep per value, or --backend hf to sweep it"
    )
    judged = {"rewards": {"correct": 1.0, "judge": 1.0}, "judge_model": "embedded"}
    with pytest.raises(ConfigError) as err:
        expand_sweep(judged, sweep_grid(["judge_context_tokens=2048,4096"]), local=False)
    assert user_message(err.value) == (
        "--sweep judge_context_tokens=2048,4096: changes the judge's vLLM engine context length (max_model_len 2048, 4096), which "
        "the configs of a sweep share: it would be rebuilt at every switch between them; expected one sweep per value, or "
        "--backend hf to sweep it"
    )
    # on transformers neither engine depends on it; nor does a key that leaves the context as it is
    assert len(expand_sweep({"backend": "hf"}, sweep_grid(["env=none,calculator"]), local=False)) == 2
    assert len(expand_sweep({**judged, "backend": "hf"}, sweep_grid(["judge_context_tokens=2048,4096"]), local=False)) == 2
    assert len(expand_sweep({}, sweep_grid(["env=calculator,guess"]), local=False)) == 2  # both 512 + 384
    assert len(expand_sweep({}, sweep_grid(["judge_context_tokens=2048,4096"]), local=False)) == 2  # no judge
    # a list whose entries change it with keys that each take one value: refused all the same
    with pytest.raises(ConfigError) as err:
        expand_sweep({"backend": "vllm"}, sweep_grid([], [{"max_new_tokens": 32}, {"seed": 1}]))
    assert user_message(err.value).startswith(
        "--sweep max_new_tokens=32,64: changes the vLLM engine's context length (max_model_len 544, 576)"
    )


def test_a_sweep_over_base_models_gives_each_config_its_base():
    members = expand_sweep({"backend": "hf"}, sweep_grid(["model=a,b", "seed=0,1"]), local=False)
    assert [(m.name, m.config.base.model, m.config.seed) for m in members] == [
        ("model=a_seed=0", "a", 0),
        ("model=a_seed=1", "a", 1),
        ("model=b_seed=0", "b", 0),
        ("model=b_seed=1", "b", 1),
    ]
    dtypes = expand_sweep({"model": "a"}, sweep_grid(["dtype=bfloat16,float32"]))
    assert [m.config.base.dtype for m in dtypes] == ["bfloat16", "float32"]
    with pytest.raises(ConfigError) as err:  # a list: the configs that leave the model alone have the default's
        expand_sweep({}, sweep_grid([], [{"model": "a"}, {"seed": 1}, {"model": "b"}, {"model": "c"}]))
    assert user_message(err.value).startswith("--sweep model=a,embedded,b,c: 4 base models")


def test_a_model_folder_names_its_config_by_its_own_name_unless_two_share_it(tmp_path):
    for folder in ("runs/x/ckpt", "runs/y/ckpt", "qwen-ft"):
        (tmp_path / folder).mkdir(parents=True)
    short = expand_sweep({}, sweep_grid([f"model={tmp_path / 'qwen-ft'},Qwen/Qwen3-0.6B"]))
    assert [m.name for m in short] == ["model=qwen-ft", "model=Qwen-Qwen3-0.6B"]
    assert short[0].overrides == {"model": str(tmp_path / "qwen-ft")}  # the config keeps the path
    same = expand_sweep({}, sweep_grid([f"model={tmp_path / 'runs/x/ckpt'},{tmp_path / 'runs/y/ckpt'}"]))
    assert [m.name for m in same] == [member_name({"model": str(tmp_path / f"runs/{p}/ckpt")}, short_paths=False) for p in "xy"]
    assert same[0].name.endswith("runs-x-ckpt") and same[0].name != same[1].name


def test_vllm_engines_of_several_bases_must_fit_on_one_gpu_together():
    """Each base's vLLM engine reserves vllm_memory_fraction of a generate replica's GPU: refused
    before starting unless they fit together, in one line naming the fraction to use."""
    with pytest.raises(ConfigError) as err:
        expand_sweep({"backend": "vllm"}, sweep_grid(["model=a,b"]))
    assert user_message(err.value) == (
        "--sweep model=a,b: 2 base models, each its own vLLM engine on a generate replica's GPU, at --vllm-memory-fraction 0.85 "
        "each (1.70 of it); expected --vllm-memory-fraction at most 0.45 to sweep them (or --backend hf)"
    )
    with pytest.raises(ConfigError, match=r"at most 0\.30"):
        expand_sweep({}, sweep_grid(["model=a,b,c"]), local=False)  # auto is vLLM on a GPU pod
    assert len(expand_sweep({"vllm_memory_fraction": 0.3}, sweep_grid(["model=a,b,c"]), local=False)) == 3
    assert len(expand_sweep({"backend": "vllm", "vllm_memory_fraction": 0.45}, sweep_grid(["model=a,b"]))) == 2
    assert len(expand_sweep({}, sweep_grid(["model=a,b"]))) == 2  # locally, on this machine's CPU, auto is transformers


def test_the_configs_reward_models_together_fit_a_reward_model_replica():
    """A sweep over rewards may name other reward models per config; a replica holds each one
    loaded, so the configs together name at most 3, and each config is named without its path's slashes."""
    members = expand_sweep({}, sweep_grid(["rewards=correct=1,org/rm-a=0.5;correct=1,org/rm-b=0.5"]))
    assert [m.config.scoring.model_rewards for m in members] == [["org/rm-a"], ["org/rm-b"]]
    assert [m.name for m in members] == ["rewards=correct=1-org-rm-a=0.5", "rewards=correct=1-org-rm-b=0.5"]
    with pytest.raises(ConfigError, match=r"rewards: the configs name 4 reward models together \(o/a, o/b, o/c, o/d\); expected at most 3"):
        expand_sweep({}, sweep_grid(["rewards=o/a=1;o/b=1;o/c=1;o/d=1"]))


def test_a_combination_the_config_refuses_is_named():
    with pytest.raises(ConfigError) as err:  # each value alone is fine; together they break a cross-field check
        expand_sweep({}, sweep_grid(["early_stop_patience=0,2", "eval_size=0,4"]))
    assert user_message(err.value).startswith("--sweep early_stop_patience=2_eval_size=0: --early-stop-patience=2 with --eval-size=0")


def test_through_the_cli_a_swept_key_cannot_also_be_a_flag_and_a_file_section_works(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_args(["--local", "--seed", "3", "--sweep", "seed=1,2"])
    assert user_message(err.value).startswith("--sweep seed: --seed is also set")
    config_file = tmp_path / "sweep.yaml"
    config_file.write_text("iterations: 2\nsweep:\n  learning_rate: [1.0e-4, 3.0e-4]\n")
    options, config, _ = parse_args(["--local", "--config", str(config_file)])
    assert [m.config.train.learning_rate for m in options["sweep"]] == [1e-4, 3e-4]
    assert config.iterations == 2 and all(m.config.iterations == 2 for m in options["sweep"])
    with pytest.raises(ConfigError, match="both as flags and in the --config file"):
        parse_args(["--local", "--config", str(config_file), "--sweep", "seed=1,2"])
    with pytest.raises(UserError, match="--sweep expects KEY=VALUE1,VALUE2"):
        parse_args(["--local", "--sweep"])
    assert parse_args(["--local", "--sweep=seed=4,5"])[0]["sweep"][1].config.seed == 5
