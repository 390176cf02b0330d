"""Run one of grpo_flyte's tasks the way a pod on a cluster runs it, with no cluster.

Three parts, each done by Flyte's own code (flyte 2.12.1):

1. **The submission** (`submit`, run as a script in a fresh process): the CLI's cluster path
   (`grpo_flyte.launch.cli.main`, `grpo_flyte.launch.submit`) runs as an offline remote dry run. Only what needs a cluster is replaced:
   the config check (`require_cluster`), the connection (`flyte.init_from_config` becomes
   `flyte.init` with the CLI's own `root_dir`), the base model upload, and the submission itself
   (`flyte.with_runcontext(mode="remote", dry_run=True, ...)` with the CLI's `copy_style`). Flyte's
   `build_code_bundle` then bundles the modules that process loaded under `root_dir`, as it would
   for a real run. The leaf tasks' specs come from `flyte.extras.serialize_env` with that bundle in
   the `SerializationContext`, as the driver pod's controller builds them.
2. **The image** (`image_python`): a virtualenv that sees the test virtualenv's packages but not
   its editable install of grpo_flyte, like an image built from a checkout (dependencies only, the
   code comes in the bundle), with flyte's `a0` console script on its PATH.
3. **The pod** (`Rehearsal.run`): inputs written as the driver's controller writes them
   (`convert_from_native_to_inputs`, `upload_inputs`), the spec's container args with the backend's
   template placeholders filled in, and `a0` run in an empty working folder with only a pod's
   environment: PATH, HOME, the spec's env vars and the variables the backend sets. `a0` downloads
   and unpacks the bundle there itself (`--tgz`, `--dest .`), imports the task through its resolver,
   and writes `outputs.pb` or `error.pb`, which are read back with `load_outputs` /
   `convert_outputs_to_native` into grpo_flyte's pydantic models.

Raw data (where tasks write the Dirs they return) is a `file://` prefix by default, as on a cluster
whose raw data is a shared file system: flyte then returns a task's folders in place, and
grpo_flyte must treat `file://` paths as local (it once took them for object-store URIs and
returned a deleted temp folder). With `raw_scheme="local://"` (fsspec's local filesystem under a
protocol flyte treats as remote) the pods upload and download through fsspec as they would with
`s3://`.

4. **The warm replica** (`Replica`): the worker environments are reusable, and on a cluster
   unionai-reuse's executor runs their actions inside one long-lived process per replica, through
   `flyte._internal.runtime.rusty`: `download_tgz` once, `load_task_from_code_bundle` once per
   task, then `run_task` per action, many at once. `Replica` starts that process (`serve_replica`,
   this file run as `replica`) with a pod's environment and sends it batches of actions over its
   stdin; it runs each batch concurrently on its one event loop and answers with what its warm
   state holds (engines built, batches, caches).

Not rehearsed: unionai-reuse's executor itself (compiled, not installed here: how it schedules
actions on the process's loop is inferred from `rusty`); secrets (HF_TOKEN) are not injected; the
image's own ENV lines are left out; no GPU (the GPU pools' GRPO_FLYTE_REQUIRE_CUDA is turned off for
the rehearsal).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import time
import venv
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RAW_SCHEMES = ("file://", "local://")
SUBMISSION_FILE = "submission.json"


# --------------------------------------------------------------------------- the image


def image_python(dest: Path) -> Path:
    """A virtualenv at `dest` with the running interpreter's packages and `a0`, without the
    editable grpo_flyte; returns its bin folder.

    The packages folder is added by a `.pth` line, which puts it on sys.path without processing
    the `.pth` files inside it (the editable install is one of those)."""
    venv.create(dest, with_pip=False)
    packages = sysconfig.get_paths()["purelib"]
    [site] = list(dest.glob("lib/python*/site-packages"))
    (site / "image_packages.pth").write_text(f"{packages}\n")
    # flyte's own console script, as pip installs it in the image: its call is under
    # `if __name__ == "__main__":`, so that a process spawned from it (torch's elastic launcher
    # spawns the train step's processes) imports it without running it again
    [entry] = importlib.metadata.entry_points(group="console_scripts", name="a0")
    module, function = entry.value.split(":")
    a0 = dest / "bin" / "a0"
    a0.write_text(
        f"#!{dest / 'bin' / 'python'}\nimport sys\nfrom {module} import {function}\n"
        f"if __name__ == '__main__':\n    sys.exit({function}())\n"
    )
    a0.chmod(0o755)
    return dest / "bin"


# --------------------------------------------------------------------------- the submission


def run_submission(
    bin_dir: Path,
    checkout_src: Path,
    extra_path: Path,
    out: Path,
    model: Path,
    rewards: str,
    settings: dict[str, str],
    options: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`submit` in a fresh process of the image's Python, with the checkout's src/ (and
    `extra_path`, a folder of modules outside it) on PYTHONPATH and the user's GRPO_FLYTE_*
    `settings`, the CLI given `rewards` and further `options` (`--agent team_agent:rollout`);
    returns what it recorded."""
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(out / "home"),
        "PYTHONPATH": f"{checkout_src}{os.pathsep}{extra_path}",
        **settings,
    }
    command = [str(bin_dir / "python"), __file__, str(out), str(model), rewards, *options]
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads((out / SUBMISSION_FILE).read_text())


def submit(out: Path, model: str, rewards: str, *options: str) -> None:
    """The CLI's cluster path as an offline dry run; records the bundle and every leaf task's spec."""
    import flyte
    import flyte.extras
    from flyte.io import Dir
    from flyte.models import SerializationContext

    from grpo_flyte import envs
    from grpo_flyte.launch import cli, submit

    roots: list[Path] = []
    submitted: list[Any] = []
    with_runcontext = flyte.with_runcontext

    def init_from_config(root_dir: Path, **_: Any) -> None:
        roots.append(root_dir)
        flyte.init(root_dir=root_dir)

    def offline_runcontext(**kwargs: Any) -> Any:
        runner = with_runcontext(mode="remote", dry_run=True, copy_bundle_to=out, **kwargs)
        run = runner.run

        def dry_run(task: Any, *args: Any, **inputs: Any) -> Any:
            submitted.append(run(task, *args, **inputs))
            return type("Run", (), {"url": "dry-run"})()  # all the CLI reads of it

        runner.run = dry_run
        return runner

    submit.require_cluster = lambda: None
    submit.resolve_remote_model = lambda path, field="model": Dir(path=Path(path).as_uri())
    flyte.init_from_config = init_from_config
    flyte.with_runcontext = offline_runcontext
    exit_code = cli.main(["--model", model, "--iterations", "1", "--rewards", rewards, *options])
    assert exit_code == 0 and submitted, f"the CLI's cluster path exited {exit_code}"

    bundle = submitted[-1].code_bundle
    ctx = SerializationContext(code_bundle=bundle, version=bundle.computed_version, root_dir=roots[-1])
    tasks = {}
    workers = (envs.rollout_env, envs.reward_env, envs.judge_env, envs.reward_model_env, envs.train_env, envs.train_dist_env)
    for env in (e for e in workers if e is not None):
        for spec in flyte.extras.serialize_env(env, ctx):
            container = spec.task_template.container
            tasks[spec.task_template.id.name] = {"args": list(container.args), "env": {kv.key: kv.value for kv in container.env}}
    record = {
        "bundle": {
            "tgz": bundle.tgz,
            "version": bundle.computed_version,
            "files": [str(Path(f).relative_to(roots[-1])) for f in bundle.files],
        },
        "driver_args": list(submitted[-1].task_spec.task_template.container.args),
        "tasks": tasks,
    }
    (out / SUBMISSION_FILE).write_text(json.dumps(record, indent=1))


# --------------------------------------------------------------------------- the pod


@dataclass
class PodRun:
    """What one pod left: its outputs (native) or its error document, and its log."""

    outputs: Any
    error: Any  # flyteidl2 ErrorDocument, or None
    workdir: Path
    raw_data: Path
    log: str
    seconds: float


class Rehearsal:
    """Runs leaf tasks as pods of one run: `run(task, *inputs)` is one action."""

    def __init__(self, root: Path, bin_dir: Path, submission: dict[str, Any], raw_scheme: str = "file://"):
        self.raw_scheme = raw_scheme
        self.root = root
        self.bin_dir = bin_dir
        self.submission = submission
        self.count = 0

    def run(self, task: Any, *args: Any) -> PodRun:
        from flyte._internal.runtime import io

        self.count += 1
        action = f"a{self.count}-{task.name.split('.')[-1]}"
        metadata = self.root / "metadata" / action
        prefix = write_inputs(task, args, metadata)

        spec = self.submission["tasks"][task.name]
        raw_data = self.root / "raw" / action
        filled = {
            "{{.input}}": io.inputs_path(prefix),
            "{{.outputPrefix}}": prefix,
            "{{.rawOutputDataPrefix}}": self.raw_scheme + str(raw_data),
            "{{.checkpointOutputPrefix}}": (self.root / "checkpoints" / action).as_uri(),
            "{{.prevCheckpointPrefix}}": "",  # a first attempt has no previous checkpoint
            "{{.runName}}": "rehearsal",
            "{{.actionName}}": action,
            "{{.runStartTime}}": datetime.now(UTC).isoformat(),
        }
        args = [filled.get(arg, arg) for arg in spec["args"]]
        assert not [a for a in args if "{{" in a], f"a placeholder this rehearsal does not fill: {args}"

        # The pod's working folder is its HOME (the flyte base image: WORKDIR /home/flyte), empty.
        workdir = self.root / "pods" / action
        workdir.mkdir(parents=True)
        env = {
            **pod_environment(self.bin_dir, workdir, spec["env"], self.root / "metadata"),
            "ACTION_NAME": action,
            "RUN_NAME": "rehearsal",
        }
        started = time.perf_counter()
        done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=300, check=False)
        seconds = time.perf_counter() - started
        log = done.stdout + done.stderr
        assert done.returncode == 0, f"a0 exited {done.returncode}:\n{log[-4000:]}"

        outputs, error = read_result(task, metadata, log)
        return PodRun(outputs=outputs, error=error, workdir=workdir, raw_data=raw_data, log=log, seconds=seconds)


def write_inputs(task: Any, args: tuple, metadata: Path) -> str:
    """What the driver's controller does for a call: serialize its inputs and write inputs.pb under
    the action's metadata folder (`metadata`); returns that folder's URI, the action's prefix."""
    from flyte._internal.runtime import convert, io

    metadata.mkdir(parents=True)  # a local "object store" needs the folder; s3 would not
    prefix = metadata.as_uri()
    inputs = asyncio.run(convert.convert_from_native_to_inputs(task.native_interface, *args))
    asyncio.run(io.upload_inputs(inputs, io.inputs_path(prefix)))
    return prefix


def read_result(task: Any, metadata: Path, log: str) -> tuple[Any, Any]:
    """(outputs as native values, None) or (None, the ErrorDocument) an action left in `metadata`."""
    from flyte._internal.runtime import convert, io
    from flyteidl2.core import execution_pb2

    outputs = error = None
    if (metadata / "outputs.pb").exists():
        loaded = asyncio.run(io.load_outputs(io.outputs_path(metadata.as_uri())))
        outputs = asyncio.run(convert.convert_outputs_to_native(task.native_interface, loaded))
    if (metadata / "error.pb").exists():
        error = execution_pb2.ErrorDocument()
        error.ParseFromString((metadata / "error.pb").read_bytes())
    assert (outputs is None) != (error is None), f"expected outputs.pb or error.pb:\n{log[-4000:]}"
    return outputs, error


def pod_environment(bin_dir: Path, home: Path, spec_env: dict[str, str], metadata: Path) -> dict[str, str]:
    """A task pod's whole environment: the image's PATH, HOME (the pod's working folder), the
    task's env vars and what the backend sets on every task pod."""
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        **spec_env,
        "FLYTE_INTERNAL_EXECUTION_PROJECT": "rehearsal",
        "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development",
        "_U_ORG_NAME": "rehearsal",
        "_U_RUN_BASE": metadata.as_uri(),
        "_U_EP_OVERRIDE": "localhost:1",  # no backend: a leaf task must never need one
        # this "node" has no GPU: the GPU pools' CUDA requirement is tested in test_rollout.py
        "GRPO_FLYTE_REQUIRE_CUDA": "0",
        # and only the CPUs the tests' process has: its share where pytest-xdist divides them (tests/conftest.py)
        **{k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ},
    }


def local_path(uri: str) -> Path:
    """The folder behind a Dir a pod published: a plain path, or a URI of one of `RAW_SCHEMES`."""
    for scheme in RAW_SCHEMES:
        uri = uri.removeprefix(scheme)
    assert "://" not in uri, f"{uri!r}: not a folder of this machine"
    return Path(uri)


# --------------------------------------------------------------------------- the warm replica

REPLY = "REPLICA-REPLY "  # starts the one line of the replica's stdout that answers a batch


@dataclass
class Call:
    """One action for a replica: `task` called with `args`, in the run named `run`."""

    task: Any
    run: str
    args: tuple


class Replica:
    """One warm replica, rehearsed: a long-lived process of the image's Python (`serve_replica`)
    that downloads the code bundle once and runs every action it is sent through
    `flyte._internal.runtime.rusty`, a batch of actions at once on its one event loop, as
    unionai-reuse's executor runs a reusable pool's actions. Inputs, outputs and raw data are those
    of `Rehearsal`; `run` returns each action's (outputs, error) and the replica's warm state."""

    def __init__(self, root: Path, bin_dir: Path, submission: dict[str, Any], raw_scheme: str = "local://", timeout_s: float = 300):
        self.root, self.submission, self.raw_scheme, self.timeout_s = root, submission, raw_scheme, timeout_s
        self.count = 0
        workdir = root / "replica"
        workdir.mkdir(parents=True)
        self.workdir = workdir
        # one pool's pod: the generate pool's environment (the train pool's holds the same settings)
        spec_env = next(t["env"] for name, t in submission["tasks"].items() if name.endswith(".generate"))
        env = pod_environment(bin_dir, workdir, spec_env, root / "metadata")
        bundle = submission["bundle"]
        self.log_file = (workdir / "replica.log").open("w")
        self.process = subprocess.Popen(
            [str(bin_dir / "python"), __file__, "replica", bundle["tgz"], bundle["version"], str(workdir / "bundle")],
            cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, text=True,
        )  # fmt: skip

    def run(self, calls: list[Call]) -> tuple[list[tuple[Any, Any]], dict[str, Any]]:
        import threading

        from flyte._internal.runtime import io

        actions, folders = [], []
        for call in calls:
            self.count += 1
            action = f"a{self.count}-{call.task.name.split('.')[-1]}"
            metadata = self.root / "metadata" / call.run / action
            prefix = write_inputs(call.task, call.args, metadata)
            args = self.submission["tasks"][call.task.name]["args"]
            resolver = args[args.index("--resolver") + 1 :]
            actions.append({
                "resolver": resolver, "run_name": call.run, "name": action, "input_path": io.inputs_path(prefix),
                "output_path": prefix, "raw_data_path": f"{self.raw_scheme}{self.root / 'raw' / call.run / action}",
                "run_base_dir": (self.root / "metadata" / call.run).as_uri(),
                "checkpoint_path": (self.root / "checkpoints" / call.run / action).as_uri(),
            })  # fmt: skip
            folders.append(metadata)
        self.process.stdin.write(json.dumps(actions) + "\n")
        self.process.stdin.flush()
        watchdog = threading.Timer(self.timeout_s, self.process.kill)
        watchdog.start()
        try:
            line = ""
            while not line.startswith(REPLY):
                line = self.process.stdout.readline()
                assert line, f"the replica exited {self.process.poll()}:\n{self.log()[-4000:]}"
        finally:
            watchdog.cancel()
        reply = json.loads(line.removeprefix(REPLY))
        results = [read_result(call.task, metadata, self.log()) for call, metadata in zip(calls, folders, strict=True)]
        return results, reply["state"]

    def log(self) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return (self.workdir / "replica.log").read_text()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log_file.close()


def serve_replica(tgz: str, version: str, dest: str) -> None:
    """The replica's process: the bundle downloaded once, each task loaded once, then batches of
    actions from stdin, each batch's actions at once on this one event loop (`rusty.run_task`)."""
    import logging

    from flyte._internal.runtime import rusty

    builds: dict[str, list[str]] = {"engine": [], "trainer": []}

    class WarmLoads(logging.Handler):
        """Records the models the replica's warm state loads (grpo_flyte logs each load once)."""

        def emit(self, record: logging.LogRecord) -> None:
            if record.msg.startswith("building the %s generator for %s"):
                builds["engine"].append(record.args[1])
            elif record.msg.startswith("loading the base model for training from %s"):
                builds["trainer"].append(record.args[0])

    package_logger = logging.getLogger("grpo_flyte")
    package_logger.addHandler(WarmLoads())
    package_logger.setLevel(logging.INFO)

    async def serve() -> None:
        controller = await rusty.create_controller(endpoint=os.environ["_U_EP_OVERRIDE"], insecure=True)
        bundle = await rusty.download_tgz(dest, version, tgz)
        tasks: dict[tuple[str, ...], Any] = {}
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            runs = []
            for action in json.loads(line):
                resolver = tuple(action.pop("resolver"))
                if resolver not in tasks:
                    tasks[resolver] = rusty.load_task_from_code_bundle(resolver[0], list(resolver[1:]))
                runs.append(
                    rusty.run_task(task=tasks[resolver], controller=controller, org="rehearsal", project="rehearsal",
                                   domain="development", version=version, code_bundle=bundle, **action)
                )  # fmt: skip
            await asyncio.gather(*runs)
            print(REPLY + json.dumps({"state": await warm_state(builds)}), flush=True)

    asyncio.run(serve())


async def warm_state(builds: dict[str, list[str]]) -> dict[str, Any]:
    """What the replica's process holds between actions: the models its engine cache and trainer
    built, its batcher's counts, and every cache with its bound."""
    from grpo_flyte import rollout, trainer
    from grpo_flyte.engine import batching
    from grpo_flyte.engine import cache as engine_cache
    from grpo_flyte.learning import policy

    def cache(c: Any) -> dict[str, int]:
        on_disk = sum(1 for p in c.root.iterdir() if p.is_dir()) if c.root.exists() else 0
        return {"entries": len(c.entries), "on_disk": on_disk, "capacity": c.capacity}

    batcher = None
    if batching.replica_batcher.cache_info().currsize:
        stats = (await batching.replica_batcher()).stats
        batcher = {"submitted": stats.total_submitted, "batches": stats.total_batches}
    held = list(engine_cache._engines.engines.values())
    return {
        "engine_builds": builds["engine"],
        "trainer_loads": builds["trainer"],
        "batcher": batcher,
        "batchers": batching.replica_batcher.cache_info().currsize,
        "engine_adapters": [[len(engine.adapters), engine.max_adapters] for engine in held],
        "trainer_models": policy._peft_model.cache_info().currsize,
        "caches": {
            "rollout models": cache(rollout._model_dirs),
            "rollout adapters": cache(rollout._adapter_dirs),
            "train models": cache(trainer._model_dirs),
            "train adapters": cache(trainer._adapter_dirs),
            "train payloads": cache(trainer._payload_dirs),
        },
    }


if __name__ == "__main__":
    if sys.argv[1] == "replica":
        serve_replica(*sys.argv[2:5])
    else:
        submit(Path(sys.argv[1]), sys.argv[2], sys.argv[3], *sys.argv[4:])
