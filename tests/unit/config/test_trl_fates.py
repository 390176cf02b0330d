"""Every field TRL's GRPOConfig adds to TrainingArguments has a fate here: it works under TRL's name,
or it is refused with a reason. Read from the installed TRL, so an upgrade that adds a field fails
here until the field is given a fate (config/trl_names.py) and a row in docs/coming-from-trl.md."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from grpo_flyte.config.errors import make_config
from grpo_flyte.config.files import load_config_file
from grpo_flyte.config.run import leaf_index
from grpo_flyte.config.trl_names import TRL_ALIASES, TRL_REFUSED, TRL_TRANSLATED
from grpo_flyte.errors import ConfigError

DOC = Path(__file__).resolve().parents[3] / "docs" / "coming-from-trl.md"


def _own_fields() -> dict[str, dataclasses.Field]:
    """GRPOConfig's fields that TrainingArguments does not have, by name."""
    import transformers
    from trl import GRPOConfig

    inherited = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.name not in inherited}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else None


def _accepted() -> set[str]:
    return set(leaf_index()) | set(TRL_ALIASES) | set(TRL_TRANSLATED)


def test_every_field_of_the_installed_grpoconfig_has_a_fate():
    fields = _own_fields()
    assert len(fields) > 60  # the reading works: TRL 1.16 adds 77
    accepted, refused = _accepted(), set(TRL_REFUSED)
    assert sorted(set(fields) - accepted - refused) == []
    assert sorted(accepted & refused) == []  # one fate each


def test_the_refused_fields_defaults_are_the_installed_trls(tmp_path):
    """A refused field at TRL's default is dropped (a dumped GRPOConfig holds every field): the
    values written down must hold TRL's default and what TRL's __post_init__ makes of it."""
    from trl import GRPOConfig

    fields = _own_fields()
    resolved = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    wrong = {name: values for name, (values, _) in TRL_REFUSED.items() if _default(fields[name]) not in values}
    wrong |= {name: values for name, (values, _) in TRL_REFUSED.items() if getattr(resolved, name) not in values}
    assert wrong == {}


@pytest.mark.parametrize("name", sorted(TRL_REFUSED))
def test_a_refused_field_set_away_from_trls_default_stops_with_its_reason(name, tmp_path):
    (default, *_), reason = TRL_REFUSED[name]
    if isinstance(default, bool):
        value = not default
    elif isinstance(default, int | float):
        value = default + 1
    else:  # None or a string
        value = 2
    expected = f"{name} (TRL's GRPOConfig) has no meaning in grpo_flyte: {reason}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_config(**{name: value})
    path = tmp_path / "trl.yaml"
    path.write_text(f"{name}: {value!r}\n".replace("True", "true").replace("False", "false"))
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config_file(path)


def test_a_refused_field_as_a_flag_stops_with_its_reason(capsys):
    from grpo_flyte.launch import cli

    assert cli.main(["--vllm-mode", "server", "--local"]) == 2
    err = capsys.readouterr().err
    assert "vllm_mode (TRL's GRPOConfig) has no meaning in grpo_flyte" in err and "generate pool" in err


def test_a_translated_name_as_a_flag_names_ours(capsys):
    from grpo_flyte.launch import cli

    assert cli.main(["--use-vllm", "true", "--local"]) == 2
    assert "--use-vllm is TRL's name for --backend in config files and Python; as a flag, give --backend" in capsys.readouterr().err


def test_a_dumped_grpoconfig_loads_with_trls_meanings(tmp_path):
    """Every field GRPOConfig adds, at TRL's defaults, is a valid config here, and the options both
    have take TRL's values (TRL's defaults differ from ours in places: a dumped config asks for TRL's)."""
    from trl import GRPOConfig

    trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    values = {name: getattr(trl, name) for name in _own_fields()}
    flat = make_config(**values).flat()
    assert (flat["group_size"], flat["max_new_tokens"], flat["loss_type"], flat["backend"]) == (8, 512, "dapo", "hf")
    assert flat["prompts_per_iter"] == trl.generation_batch_size // trl.num_generations  # one prompt's 8 completions
    assert (flat["epsilon"], flat["epsilon_high"], flat["beta"], flat["temperature"]) == (0.2, 0.2, 0.0, 1.0)
    assert (flat["is_cap"], flat["is_mode"], flat["truncated"]) == (3.0, "sequence_mask", "keep")


def test_the_doc_gives_every_field_a_row():
    text = DOC.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    missing = [name for name in _own_fields() if not any(f"`{name}`" in row for row in rows)]
    assert missing == []


def test_trl_names_read_nested_parts_and_trls_precedence():
    """reward_weights pairs with nested rewards; generation_batch_size divides by a nested group
    size; TRL's deprecated cap wins over clip_max (as TRL's __post_init__ does); clip_max None is no bound."""
    config = make_config(scoring={"rewards": {"correct": 1.0, "format": 1.0}}, reward_weights=[2.0, 0.5])
    assert config.scoring.rewards == {"correct": 2.0, "format": 0.5}
    assert make_config(sampling={"group_size": 4}, generation_batch_size=16).prompts_per_iter == 4
    assert make_config(vllm_importance_sampling_cap=5.0, vllm_importance_sampling_clip_max=3.0).train.is_cap == 5.0
    assert make_config(vllm_importance_sampling_clip_max=None).train.is_cap == 1000.0


def test_an_entropy_mask_with_dropout_is_refused():
    with pytest.raises(ConfigError, match=r"--top-entropy-quantile=0.5 with --lora-dropout=0.1: .* expected --lora-dropout 0"):
        make_config(top_entropy_quantile=0.5, lora_dropout=0.1)
