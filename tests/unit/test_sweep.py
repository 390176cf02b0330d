"""train_sweep, the cluster sweep's parent task, in Flyte local mode: it fans out train_rl, returns
each config's result and publishes the comparison; locally it refuses more than one config, which
would share one raw data folder and checkpoint."""

from __future__ import annotations

import flyte
import pytest
from flyte.io import Dir

from grpo_flyte import sweep
from grpo_flyte.config.grid import expand_sweep
from grpo_flyte.sweep import train_sweep

TINY = {"max_new_tokens": 8, "prompts_per_iter": 2, "group_size": 3, "eval_size": 2, "min_informative_groups": 0, "iterations": 1}


def test_the_parent_task_trains_its_config_and_reports_the_comparison(tmp_path, tiny_model_dir, monkeypatch):
    shown = []
    original = sweep.render_sweep_fragment
    monkeypatch.setattr(
        sweep, "render_sweep_fragment", lambda outcomes, status: shown.append((outcomes, status)) or original(outcomes, status)
    )
    members = expand_sweep({**TINY, "model": str(tiny_model_dir)}, {"learning_rate": ["3e-4"]})
    runner = flyte.with_runcontext(mode="local", name="sweep-test", raw_data_path=str(tmp_path / "raw"))
    result = runner.run(train_sweep, members=members, base_models={str(tiny_model_dir): Dir(path=str(tiny_model_dir))}).outputs()[0]
    (only,) = result.configs
    assert only.name == "learning_rate=3e-4" and only.error is None
    assert [row.iteration for row in only.result.history] == [0, 1]
    ((outcomes, status),) = shown  # the comparison, as the parent's report tab shows it
    assert status == "complete" and [(o.name, o.status, len(o.history)) for o in outcomes] == [("learning_rate=3e-4", "complete", 2)]


def test_locally_the_parent_task_refuses_several_configs_before_training(tmp_path, tiny_model_dir):
    members = expand_sweep({**TINY, "model": str(tiny_model_dir)}, {"seed": [0, 1]})
    runner = flyte.with_runcontext(mode="local", name="sweep-test-2", raw_data_path=str(tmp_path / "raw"))
    with pytest.raises(Exception, match="shares one raw data folder and checkpoint between its configs in Flyte local mode"):
        runner.run(train_sweep, members=members, base_models={str(tiny_model_dir): Dir(path=str(tiny_model_dir))})
    assert not (tmp_path / "raw" / "adapters").exists()


def test_a_config_whose_base_model_has_no_folder_is_refused_before_training(tmp_path, tiny_model_dir):
    members = expand_sweep({**TINY, "model": str(tiny_model_dir)}, {"seed": [0]})
    runner = flyte.with_runcontext(mode="local", name="sweep-test-3", raw_data_path=str(tmp_path / "raw"))
    with pytest.raises(Exception, match=f"base_models has no folder for model {str(tiny_model_dir)!r}"):
        runner.run(train_sweep, members=members, base_models={"elsewhere": Dir(path=str(tiny_model_dir))})
    assert not (tmp_path / "raw" / "adapters").exists()
