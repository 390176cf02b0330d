"""W&B tracking: the run a cluster run's submitter chooses travels in the run's context, where
flyteplugins-wandb's link reads it and the driver logs to it."""

from __future__ import annotations

import flyte
import pytest
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.reporting.tracking import WandbRun

LINK_ARGS = {"run_name": "r1", "project": "p", "domain": "development", "parent_action_name": "a0", "action_name": "a0", "pod_name": "pod"}


def test_the_context_names_the_run_where_the_plugins_link_finds_it():
    chosen = WandbRun(project="grpo", id="0123456789ab", entity="my-team")
    context = chosen.context()
    assert {k: context[k] for k in ("wandb_project", "wandb_id", "wandb_entity")} == {
        "wandb_project": "grpo", "wandb_id": "0123456789ab", "wandb_entity": "my-team",
    }  # fmt: skip
    assert all(isinstance(v, str) for v in context.values())  # a Flyte custom context holds strings
    assert WandbRun.link().get_link(context=context, **LINK_ARGS) == "https://wandb.ai/my-team/grpo/runs/0123456789ab"
    assert WandbRun.from_context(context) == chosen
    # without an entity the plugin's link can only open W&B's front page
    assert WandbRun.link().get_link(context=WandbRun(project="grpo", id="x").context(), **LINK_ARGS) == "https://wandb.ai"
    assert WandbRun.from_context(None) is None and WandbRun.from_context({"other": "1"}) is None


class _FakeWandb:
    """Records wandb.init's arguments; the run it returns takes logs and finishes."""

    def __init__(self):
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return type("Run", (), {"log": lambda self, *a, **k: None, "finish": lambda self, **k: None})()


def test_the_driver_logs_to_the_run_its_context_names_and_a_resumed_loop_keeps_its_own(tmp_path, tiny_model_dir, monkeypatch):
    import wandb

    fake = _FakeWandb()
    monkeypatch.setattr(wandb, "init", fake.init)
    from grpo_flyte.driver import train_rl

    config = RunConfig(iterations=1, prompts_per_iter=2, group_size=2, max_new_tokens=4, eval_size=0, min_informative_groups=0,
                       wandb_project="grpo")  # fmt: skip
    raw = tmp_path / "raw"

    def run(context: dict[str, str], **inputs):
        runner = flyte.with_runcontext(mode="local", raw_data_path=str(raw), custom_context=context)
        return runner.run(train_rl, config=config, base_model=Dir(path=str(tiny_model_dir)), **inputs).outputs()[0]

    run(WandbRun(project="grpo", id="chosen000001", entity="my-team").context())
    assert [(i["project"], i["id"], i["entity"], i["resume"]) for i in fake.inits] == [("grpo", "chosen000001", "my-team", "allow")]

    # a resumed loop continues the W&B run in its checkpoint, whatever the new run's context says
    config = config.model_copy(update={"iterations": 2})
    result = run(WandbRun(project="grpo", id="another00002").context(), resume_from=str(raw / "checkpoint"))
    assert [row.iteration for row in result.history] == [1, 2]
    assert fake.inits[1]["id"] == "chosen000001"

    # no context (a local run): a new id, and wandb's own entity
    fake.inits.clear()
    raw = tmp_path / "raw2"
    config = config.model_copy(update={"iterations": 1})
    run({})
    (init,) = fake.inits
    assert len(init["id"]) == 12 and init["id"] not in ("chosen000001", "another00002") and init["entity"] is None


def test_a_sweep_configs_run_is_named_and_grouped_in_wandb_and_its_id_is_its_own(monkeypatch):
    """The driver of a sweep's config opens the W&B run its context names (`WandbRun.for_config`):
    wandb.init gets its id, its name (the config's) and its group (the sweep's id); the sweep's
    link opens the group. A lone run's has neither name nor group (wandb's own)."""
    import wandb

    from grpo_flyte.reporting.trackers import Trackers
    from grpo_flyte.reporting.tracking import WandbGroupLink

    fake = _FakeWandb()
    monkeypatch.setattr(wandb, "init", fake.init)
    config = RunConfig(wandb_project="grpo")
    sweep = WandbRun(project="grpo", id="sweep0000001", entity="my-team", group="sweep0000001")
    run = sweep.for_config("learning_rate=1e-4")
    assert WandbRun.from_context(run.context()) == run
    assert run.id == "sweep0000001-" + __import__("hashlib").sha256(b"learning_rate=1e-4").hexdigest()[:12]
    Trackers(config, run.id, None, run).finish()
    Trackers(config, "lone00000001", None, WandbRun(project="grpo", id="lone00000001")).finish()
    assert [(i["id"], i["name"], i["group"], i["resume"]) for i in fake.inits] == [
        (run.id, "learning_rate=1e-4", "sweep0000001", "allow"),
        ("lone00000001", None, None, "allow"),
    ]
    assert WandbGroupLink().get_link(context=sweep.context(), **LINK_ARGS) == "https://wandb.ai/my-team/grpo/groups/sweep0000001"
    assert WandbGroupLink().get_link(context=WandbRun(project="grpo", id="x").context(), **LINK_ARGS) == "https://wandb.ai"


@pytest.mark.parametrize("module", ["wandb", "flyteplugins"])
def test_importing_the_package_leaves_wandb_and_the_plugin_out(module):
    import subprocess
    import sys

    code = f"import grpo_flyte.launch.cli, grpo_flyte.driver, grpo_flyte.reporting.tracking, sys; print({module!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
