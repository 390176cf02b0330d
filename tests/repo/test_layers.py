"""The package's shape: named layers of rooms, an order inside each room, no cycle, small modules.

A room is a package (`grpo_flyte/engine/`) or a module of the top level (`grpo_flyte/driver.py`).
Every `grpo_flyte` import counts, module-level or inside a function (a lazy import is still a
dependency). A new module must be listed in its room's order here, and a new room in a layer.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpo_flyte

PACKAGE = Path(grpo_flyte.__file__).resolve().parent

# Bottom to top: a room imports only rooms of lower layers (rooms of one layer never import each other).
LAYERS = (
    ("records",),  # the parts of the metrics row: what an iteration measured
    ("errors", "types"),  # the values every module shares
    ("runtime",),  # the process's machinery: files, storage, the torch thread, child processes, the sandbox, the device
    ("reward_fns", "multiturn", "tools"),  # what users extend: reward functions, RL environments, tools as Python functions
    ("scoring",),  # composing rewards into a group's scores; the LLM judge's pure parts
    ("config",),  # the one config object, its files, TRL's names, a sweep's grid
    ("__init__",),  # the package's own names (RunConfig, MultiTurnEnv, Reply), imported on first use
    ("models",),  # base models: the embedded one, folders and Hub ids, loading, attention; the reward models
    ("data", "learning"),  # datasets and prompt sampling; the GRPO math, the policy and its update
    ("engine",),  # generation: the generators, their cache and batching, decoding, episodes, prompts
    ("envs",),  # the image and the Flyte task environments
    ("rollout", "reward", "judge", "trainer"),  # the task modules, side by side
    ("reporting",),  # the console's progress, tracking, the Hub's model card, the report's HTML parts and the sweep's report
    ("report_helpers",),  # the run report
    ("loop",),  # the driver's parts: batches, the pipeline, evaluations, the guard, metrics, the loop state, publishing
    ("driver",),  # train_rl
    ("sweep",),  # train_sweep: one train_rl per config on a cluster
    ("launch",),  # the command line, local run and sweep folders, the checks before start, cluster submission
    ("__main__",),  # python -m grpo_flyte
)
TASK_MODULES = {"rollout", "reward", "judge", "trainer"}

# Inside a package, bottom to top: a module imports only modules listed before it (its `__init__`
# may import any of them, to re-export a public path).
INSIDE = {
    "runtime": ("closing_lru", "allocator", "memory", "files", "cache", "child_processes", "device", "torch_thread", "sandbox", "storage"),
    "scoring": ("judging", "workers", "compose"),
    "tools": ("functions", "formats", "execution"),
    "config": (
        "trl_names",
        "defaults",
        "constants",
        "part",
        "generation",
        "episode",
        "training",
        "run",
        "errors",
        "files",
        "table",
        "grid",
    ),
    "models": ("attention", "loading", "embedded", "folders", "gguf_writer", "reward_model"),
    "learning": ("distribution", "grpo", "losses", "policy", "update", "data_parallel", "merge"),
    "engine": (
        "sampling",
        "grammar",
        "prefix_cache",
        "mixed_lora",
        "prompts",
        "interface",
        "decode_loop",
        "vllm_generator",
        "hf_generator",
        "cache",
        "batching",
        "episodes",
        "tool_episodes",
        "chat_client",
        "agents",
    ),
    "reporting": ("figures", "html", "charts", "cost", "tracking", "trackers", "progress", "hub", "sweep_report"),
    "loop": (
        "answers",
        "metrics",
        "guard",
        "verification",
        "state",
        "observers",
        "lockstep",
        "pruning",
        "publishing",
        "batches",
        "pipeline",
        "evaluation",
        "shipping",
    ),
    "launch": (
        "preflight",
        "run_folder",
        "lock",
        "run_log",
        "stopping",
        "run_files",
        "local_run",
        "sweep_plan",
        "sweep_folder",
        "submit",
        "exporting",
        "cli",
    ),
}
MAX_TOP_LEVEL = 16
MAX_LINES = 500


def _imports(path: Path) -> set[str]:
    """The grpo_flyte modules `path` imports (dotted, below `grpo_flyte.`), anywhere in it but an
    `if __name__ == "__main__":` block; `from grpo_flyte.pkg import mod` counts as `pkg.mod`."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "grpo_flyte":
            below = node.module.split(".")[1:]
            if below and not (PACKAGE.joinpath(*below).is_dir()):
                found.add(".".join(below))
            else:  # from grpo_flyte import grpo_module / from grpo_flyte.engine import cache, or a package's re-export
                for alias in node.names:
                    dotted = ".".join([*below, alias.name])
                    is_module = PACKAGE.joinpath(*below, alias.name + ".py").is_file() or PACKAGE.joinpath(*below, alias.name).is_dir()
                    found.add(dotted if is_module else ".".join(below) or "__init__")
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("grpo_flyte."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _dotted(path: Path) -> str:
    """'engine.cache' for grpo_flyte/engine/cache.py, 'engine' for its __init__, 'driver' for driver.py."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)


def _graph() -> dict[str, set[str]]:
    return {_dotted(p): _imports(p) - {_dotted(p)} for p in sorted(PACKAGE.rglob("*.py"))}


def _room(dotted: str) -> str:
    return dotted.split(".")[0]


def _layer(room: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def test_every_module_has_a_room_and_every_package_an_order():
    rooms = {r for layer in LAYERS for r in layer}
    modules = set(_graph())
    assert {_room(m) for m in modules} == rooms
    for package, order in INSIDE.items():
        inside = {m.split(".", 1)[1] for m in modules if m.startswith(package + ".")}
        assert inside == set(order), package
    assert {m for m in modules if "." not in m and (PACKAGE / m).is_dir()} == set(INSIDE)


def test_rooms_import_only_lower_layers():
    upward = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps if _room(d) != _room(m) and _layer(_room(d)) >= _layer(_room(m))]
    assert upward == []


def test_inside_a_package_modules_import_only_those_below_them():
    upward = []
    for m, deps in _graph().items():
        package = _room(m)
        if package not in INSIDE or m == package:  # a package's __init__ may re-export any of its modules
            continue
        order = INSIDE[package]
        own = order.index(m.split(".", 1)[1])
        upward += [f"{m} -> {d}" for d in deps if d.startswith(package + ".") and order.index(d.split(".", 1)[1]) >= own]
        upward += [f"{m} -> {d} (its package's __init__)" for d in deps if d == package]
    assert upward == []


def test_no_cycle_between_rooms():
    """Implied by the layers, checked on its own so that a cycle is named as one."""
    edges = {r: set() for layer in LAYERS for r in layer}
    for m, deps in _graph().items():
        edges[_room(m)] |= {_room(d) for d in deps if _room(d) != _room(m)}
    done: set[str] = set()

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(edges[node]):
            if found := cycle_from(nxt, [*path, node]):
                return found
        done.add(node)
        return None

    assert [c for r in sorted(edges) if (c := cycle_from(r, []))] == []


def test_task_modules_do_not_import_each_other():
    graph = _graph()
    for module in TASK_MODULES:
        assert {_room(d) for d in graph[module]} & TASK_MODULES == set(), module


def test_only_the_launchers_import_the_driver_and_only_main_imports_the_command_line():
    graph = _graph()
    assert {_room(m) for m, deps in graph.items() if "driver" in deps} == {"launch", "sweep"}
    assert {m for m, deps in graph.items() if "launch.cli" in deps} == {"__main__"}


def test_the_top_level_is_small_and_no_module_is_long():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_importing_any_module_loads_no_heavy_library():
    """Every module, the package's and each room's __init__ included, imports in a fresh interpreter
    without torch, transformers, peft or vLLM: they are imported inside the functions that use them."""
    probe = textwrap.dedent(
        """
        import importlib, json, pkgutil, sys
        import grpo_flyte
        heavy = {}
        for info in pkgutil.walk_packages(grpo_flyte.__path__, "grpo_flyte."):
            importlib.import_module(info.name)
            loaded = [m for m in ("torch", "transformers", "peft", "vllm") if m in sys.modules]
            if loaded:
                heavy[info.name] = loaded
                break
        print(json.dumps(heavy))
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_import_checker_sees_lazy_and_package_imports(tmp_path):
    """The checker itself: an import inside a function, `from grpo_flyte import x`, a module of a
    room imported from its package and a name re-exported by a package all count."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from grpo_flyte import driver, envs\n"
        "from grpo_flyte.engine import batching\n"
        "from grpo_flyte.config import RunConfig\n"
        "def f():\n    from grpo_flyte.rollout import generate\n    import grpo_flyte.learning.grpo\n"
        "if __name__ == '__main__':\n    from grpo_flyte.launch.cli import main\n"
    )
    assert _imports(source) == {"driver", "envs", "engine.batching", "config", "rollout", "learning.grpo"}


# What users and the examples import: these paths keep working whatever moves inside the package.
PUBLIC_NAMES = {
    "grpo_flyte": ("MultiTurnEnv", "Reply", "RunConfig", "__version__"),
    "grpo_flyte.config": ("RunConfig", "ModelConfig", "TrainConfig", "GuardConfig"),
    "grpo_flyte.driver": ("train_rl",),
    "grpo_flyte.sweep": ("train_sweep",),
    "grpo_flyte.models": ("embedded_model_dir",),
    "grpo_flyte.rollout": ("generate", "generate_eval"),
    "grpo_flyte.reward": ("score_group", "score_groups"),
    "grpo_flyte.judge": ("judge_group", "reward_model_group"),
    "grpo_flyte.trainer": ("init_adapter", "train_step", "merge_adapter"),
    "grpo_flyte.envs": ("image", "settings", "rollout_env", "reward_env", "judge_env", "reward_model_env", "train_env", "driver_env"),
    "grpo_flyte.types": ("AdapterRef", "Example", "RunResult", "MetricsRow"),
    "grpo_flyte.reward_fns": ("correct_reward", "format_reward"),
    "grpo_flyte.multiturn": ("MultiTurnEnv", "Reply"),
    "grpo_flyte.errors": ("GrpoFlyteError",),
}
TASK_NAMES = {
    "grpo_flyte-driver.train_rl",
    "grpo_flyte-driver.train_sweep",
    "grpo_flyte-judge.judge_group",
    "grpo_flyte-reward-model.reward_model_group",
    "grpo_flyte-reward.score_group",
    "grpo_flyte-reward.score_groups",
    "grpo_flyte-reward.start_reward_workers",
    "grpo_flyte-rollout.generate",
    "grpo_flyte-rollout.generate_eval",
    "grpo_flyte-train.init_adapter",
    "grpo_flyte-train.merge_adapter",
    "grpo_flyte-train.train_step",
    "grpo_flyte-train.write_gguf",
}


def test_the_public_paths_and_the_flyte_task_names_keep_working():
    import importlib

    missing = [
        f"{module}.{name}" for module, names in PUBLIC_NAMES.items() for name in names if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []
    from grpo_flyte import driver, envs, judge, reward, rollout, sweep, trainer  # noqa: F401 (their tasks join the environments)

    pools = [envs.rollout_env, envs.reward_env, envs.judge_env, envs.reward_model_env, envs.train_env, envs.driver_env]
    assert {task.name for env in pools for task in env.tasks.values()} == TASK_NAMES


def test_the_examples_import_only_public_paths():
    """An example imports top-level modules of the package, or names a package re-exports (its
    `__all__`): never a module inside a room, which may move."""
    import importlib

    inner, examples = [], sorted((PACKAGE.parents[1] / "examples").glob("*.py"))
    assert examples
    for path in examples:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_flyte"):
                below = node.module.split(".")[1:]
                if len(below) > 1 or (
                    below
                    and PACKAGE.joinpath(*below).is_dir()
                    and not all(a.name in getattr(importlib.import_module(node.module), "__all__", ()) for a in node.names)
                ):
                    inner.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
    assert inner == []
