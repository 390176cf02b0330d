"""A big grid says what it is about to do: the memory its configs take at once (hand-computed on a
tiny model's figures), a grid that cannot fit refused in one line before anything is written, and
lines that say how far a long check has come."""

from __future__ import annotations

import json
import logging

import pytest

from grpo_flyte.config import grid
from grpo_flyte.config.grid import CheckProgress, expand_sweep
from grpo_flyte.errors import UserError
from grpo_flyte.launch import sweep_plan
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.launch.sweep_plan import model_figures, plan_line, plan_sweep

SETTINGS = {"prompts_per_iter": 2, "group_size": 3, "max_prompt_tokens": 24, "max_new_tokens": 8, "micro_batch_tokens": 64,
            "lora_rank": 4, "lora_target_modules": ("q_proj", "v_proj")}  # fmt: skip


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_memory_of_a_grid_at_once_hand_computed(model_dir):
    figures = model_figures(model_dir)
    # no weight files: 100 x 32 embeddings + 12 x 32^2 x 2 layers = 27776 parameters;
    # K and V: 2 x 2 layers x 2 kv heads x head_dim 8 x 4 bytes = 256 bytes per token
    assert (figures.params, figures.kv_bytes_per_token) == (27776, 256)
    members = expand_sweep(SETTINGS, {"seed": [0, 1, 2]})
    plan = plan_sweep(members, {m.name: model_dir for m in members})
    assert plan.shared == 2 * 27776 * 4  # a generator and a trainer copy, float32
    assert plan.train_step == 64 * 100 * 4 * 3  # micro_batch_tokens x vocab x 4 bytes x 3
    # 6 rows x (24 + 8) tokens x 256 bytes of KV, and 16 bytes x rank 4 x 4 x 32 x 2 layers x 2 modules
    assert plan.per_config == 6 * 32 * 256 + 16 * 4 * 4 * 32 * 2 * 2 == 81920
    assert plan.total == 222208 + 76800 + 3 * 81920
    assert plan.fitting(400_000) == 1  # (400000 - 222208 - 76800) // 81920
    assert "3 configs at once take about" in plan_line(plan, 10**9)
    with pytest.raises(UserError) as refused:
        plan_line(plan, 400_000)
    assert "more than this machine's" in str(refused.value) and "about 1 configs fit" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_long_check_says_how_far_it_has_come_every_few_seconds(caplog):
    now = [0.0]
    progress = CheckProgress("checking the sweep's configs", 5, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=grid.__name__):
        for done, at in enumerate((0.5, 2.5, 3.0, 4.0, 5.0), start=1):
            now[0] = at
            progress.step(done)
    assert [r.getMessage() for r in caplog.records] == [
        "checking the sweep's configs: 2 of 5",  # 2.5 s after the start
        "checking the sweep's configs: 5 of 5 in 5 s",  # the end of a check that said something
    ]
    quiet = CheckProgress("quick", 2, clock=lambda: 0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=grid.__name__):
        quiet.step(1)
        quiet.step(2)
    assert caplog.records == []  # a quick check says nothing


def test_a_grid_that_cannot_fit_is_refused_in_one_line_and_writes_nothing(tmp_path, tiny_model_dir, monkeypatch, capsys, caplog):
    sweep_dir = tmp_path / "sweep"
    args = ["--local", "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3",
            "--eval-size", "2", "--iterations", "1", "--run-dir", str(sweep_dir), "--sweep", "seed=0,1,2"]  # fmt: skip
    monkeypatch.setattr(sweep_plan, "machine_memory", lambda: 1000)
    monkeypatch.setattr("grpo_flyte.launch.sweep_folder.machine_memory", lambda: 1000)
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the sweep's 3 configs at once take about") and "about 0 configs fit" in err and "\n" not in err
    assert not sweep_dir.exists()
