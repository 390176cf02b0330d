"""The package's import graph: one-way layers, task modules side by side, no cycle.

Every `grpo_flyte` import counts, module-level or inside a function (a lazy import is still a
dependency). A new module must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grpo_flyte

PACKAGE = Path(grpo_flyte.__file__).resolve().parent

# Bottom to top: a module may import only modules of a lower layer.
LAYERS = {
    # 0-2: no grpo_flyte imports but errors and types (shared types, pure helpers and math, the
    # allocator's settings); the torch thread; the reward sandbox, the reward functions and the
    # multi-turn environments, each owning its registry of names; the config's dependent defaults
    "errors": 0, "types": 0, "files": 0, "allocator": 0, "child_processes": 0, "decoding": 0, "grpo": 0, "tracking": 0, "mixed_lora": 0,
    "torch_thread": 1, "sandbox": 1, "multiturn": 1, "reward_fns": 2, "episodes": 2, "config_defaults": 2, "lockstep": 2,
    # 3: TRL's names for options; the report renderer; the LLM judge's prompt, rubric, reply parsing and chunking
    "trl_names": 3, "report_helpers": 3, "judging": 3, "sweep_report": 4,
    # 4: the run's config (it checks reward and environment names with their registries)
    "config": 4,
    # 5: beside the config, its error text and its table of options; models, prompts, data, metrics, progress text
    "config_errors": 5, "config_table": 5, "__init__": 5,
    "models": 5, "prompts": 5, "data": 5, "metrics": 5, "progress": 5,
    # 6: config files; storage, engines, the task environments; the run's guard (the best adapter,
    # collapses, early stop: pure, on the recorded metrics); the trained policy and its adapter
    # folder; the merge
    "config_files": 6, "sweep_grid": 6, "storage": 6, "hub": 6, "engines": 6, "envs": 6, "guard": 6, "policy": 6, "merge": 6,
    # 7: the GRPO step on the policy; the loop's checkpointed state; the checks before start
    "policy_update": 7, "loop_state": 7, "preflight": 7,
    # 8: the train step over several processes
    "data_parallel": 8,
    # 9: the task modules, side by side
    "rollout": 9, "reward": 9, "judge": 9, "trainer": 9,
    # 10-11: the loop's parts: who observes a run; an iteration's batch and its train step; generation
    # ahead of training, the held-out evaluation, the report and the push to the Hub
    "observers": 10, "batches": 10, "pipeline": 11, "evaluation": 11, "publishing": 11,
    # 12-16: the driver; a sweep's parent task and a local run's folder; a cluster submission and a
    # local sweep's folder; the command line; `python -m grpo_flyte`
    "driver": 12, "sweep": 13, "run_folder": 13, "submit": 14, "sweep_folder": 14, "cli": 15, "__main__": 16,
}  # fmt: skip
TASK_MODULES = {"rollout", "reward", "judge", "trainer"}


def _imports(path: Path) -> set[str]:
    """The grpo_flyte modules `path` imports, anywhere in it but an `if __name__ == "__main__":` block."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "grpo_flyte":
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from grpo_flyte import grpo, engines
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("grpo_flyte."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found - {path.stem}


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) for p in sorted(PACKAGE.glob("*.py"))}


def test_every_module_has_a_layer():
    assert set(_graph()) == set(LAYERS)


def test_imports_go_down_the_layers_only():
    upward = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps if LAYERS[d] >= LAYERS[m]]
    assert upward == []


def test_task_modules_do_not_import_each_other():
    graph = _graph()
    for module in TASK_MODULES:
        assert graph[module] & TASK_MODULES == set(), module


def test_only_the_launchers_import_the_driver_and_nothing_imports_the_cli():
    graph = _graph()
    assert {m for m, deps in graph.items() if "driver" in deps} == {"run_folder", "submit", "sweep", "sweep_folder"}
    assert {m for m, deps in graph.items() if "cli" in deps} == {"__main__"}


def test_the_import_checker_sees_lazy_and_package_imports(tmp_path):
    """The checker itself: an import inside a function and `from grpo_flyte import x` both count."""
    source = tmp_path / "sample.py"
    source.write_text(
        "from grpo_flyte import grpo, engines\n"
        "def f():\n    from grpo_flyte.rollout import generate\n    import grpo_flyte.trainer\n"
        "if __name__ == '__main__':\n    from grpo_flyte.launch.cli import main\n"
    )
    assert _imports(source) == {"grpo", "engines", "rollout", "trainer"}
