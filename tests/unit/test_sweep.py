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


LINK_ARGS = {"run_name": "r1", "project": "p", "domain": "development", "parent_action_name": "a0", "action_name": "a1", "pod_name": "pod"}


class _TrainRlCalls:
    """Stands in for train_rl under train_sweep: records, for each config's call, the custom
    context the call is submitted with (what the config's driver reads, `flyte.ctx()` in it) and
    the links on its task (what its page in the Flyte UI shows); then fails the config."""

    def __init__(self, calls: list | None = None, links=()):
        self.calls, self.links = ([] if calls is None else calls), links

    def override(self, links=(), **_):
        return _TrainRlCalls(self.calls, links)

    async def __call__(self, config, *args):
        self.calls.append((config.seed, dict(flyte.ctx().custom_context), self.links))
        raise RuntimeError("recorded")


def test_each_config_of_a_sweep_logs_to_a_wandb_run_of_its_own_grouped_under_the_sweep(tmp_path, tiny_model_dir, monkeypatch):
    """The submitter chooses one W&B id for a sweep (its custom context); each config's train_rl is
    submitted with a run of its own (an id derived from the sweep's and the config's name, so that a
    retried or recovered sweep reattaches each config to its run), named for the config and grouped
    under the sweep's id, and its task's W&B link opens that run."""
    from grpo_flyte.reporting.tracking import WandbRun

    calls = _TrainRlCalls()
    monkeypatch.setattr(sweep, "train_rl", calls)
    monkeypatch.setattr(sweep, "is_remote", lambda path: True)  # as on a cluster: several configs allowed
    members = expand_sweep({**TINY, "model": str(tiny_model_dir)}, {"seed": [0, 1]})
    chosen = WandbRun(project="grpo", id="sweep0000001", entity="my-team", group="sweep0000001")
    runner = flyte.with_runcontext(mode="local", name="sweep-wandb", raw_data_path=str(tmp_path / "raw"), custom_context=chosen.context())
    result = runner.run(train_sweep, members=members, base_models={str(tiny_model_dir): Dir(path=str(tiny_model_dir))}).outputs()[0]
    assert [c.error for c in result.configs] == ["recorded", "recorded"]

    runs = {seed: WandbRun.from_context(context) for seed, context, _ in calls.calls}
    assert [(r.project, r.entity, r.group, r.name) for r in (runs[0], runs[1])] == [
        ("grpo", "my-team", "sweep0000001", "seed=0"),
        ("grpo", "my-team", "sweep0000001", "seed=1"),
    ]
    assert runs[0].id != runs[1].id and "sweep0000001" not in (runs[0].id, runs[1].id)
    assert runs[0] == chosen.for_config("seed=0")  # the same sweep and config name: the same run, on a retry too
    assert all(len(r.id) <= 64 and r.id.replace("-", "").isalnum() for r in runs.values())  # a W&B run id
    for seed, context, links in calls.calls:
        (link,) = links
        assert link.get_link(context=context, **LINK_ARGS) == f"https://wandb.ai/my-team/grpo/runs/{runs[seed].id}"

    # without W&B the configs' calls are as before: no W&B context, no link
    calls.calls.clear()
    runner = flyte.with_runcontext(mode="local", name="sweep-no-wandb", raw_data_path=str(tmp_path / "raw2"))
    runner.run(train_sweep, members=members, base_models={str(tiny_model_dir): Dir(path=str(tiny_model_dir))})
    assert [(WandbRun.from_context(context), links) for _, context, links in calls.calls] == [(None, ()), (None, ())]
