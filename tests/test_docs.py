"""The README is the contract: its config table and commands must match the code."""

from pathlib import Path

from grpo_flyte.config import config_table_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_table_is_generated_from_runconfig():
    assert config_table_markdown() in (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert "make test" in readme and "make demo" in readme
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci_lines


def test_the_readme_python_example_runs(tmp_path):
    """The first screen's Python block, run as a user would paste it (the embedded model, Flyte
    local mode): it prints the final held-out reward and the adapter's folder. As `python -c BLOCK`
    (a warm one: tests/warm_python.py)."""
    import warm_python

    text = (ROOT / "README.md").read_text()
    block = text.split("**From Python**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    proc = warm_python.run(["-c", block], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reward, adapter = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert 0.0 <= float(reward) <= 1.2 and (Path(adapter) / "adapter_model.safetensors").is_file()


def test_the_readme_custom_environment_is_complete_short_and_plays(tmp_path, monkeypatch, embedded_dir):
    """The README's own environment, saved as a user would: under 30 lines, it loads by
    module:Class and plays an episode (a tool call, the tool's answer, the end)."""
    import asyncio

    from transformers import AutoTokenizer

    from grpo_flyte.episodes import Budgets, Splicer, new_environment, run_episode
    from grpo_flyte.multiturn import load_environment
    from grpo_flyte.types import Example, Rollout

    text = (ROOT / "README.md").read_text()
    block = text.split("**Your own environment**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert len(block.strip().splitlines()) < 30
    (tmp_path / "my_env.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = load_environment("my_env:WordCount")
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_dir))
    turns = iter(["<count>one two three</count>", "#### 3<|im_end|>"])

    async def sample_turn(context, max_new_tokens, turn):
        ids = tokenizer(next(turns), add_special_tokens=False)["input_ids"]
        return Rollout(completion_ids=ids, sampling_logprobs=[0.0] * len(ids), finish_reason="stop", text="")

    env = new_environment(cls, Example(question="How many words?", answer="3"))
    budgets = Budgets(max_turns=4, max_turn_tokens=32, max_episode_tokens=256, tool_timeout_s=5.0)
    rollout = asyncio.run(run_episode(env, [1], sample_turn, Splicer(tokenizer, chat=True), budgets))
    assert [(t.role, t.text) for t in rollout.episode.turns] == [
        ("model", "<count>one two three</count>"),
        ("tool", "3"),
        ("model", "#### 3"),
    ]
    assert rollout.episode.tool_calls == 1 and rollout.episode.end == "done"


def test_the_readme_module_map_names_every_module_once_at_its_layer():
    """'How it works' has one line per module of the package, at the layer tests/test_layers.py gives it."""
    from test_layers import LAYERS

    text = (ROOT / "README.md").read_text()
    block = text.split("layer  module            its job\n", 1)[1].split("```", 1)[0]
    rows = [line.split(maxsplit=2) for line in block.strip().splitlines()]
    assert all(len(row) == 3 for row in rows)  # a layer, a module, its job
    assert sorted(module for _, module, _ in rows) == sorted(m for m in LAYERS if m != "__init__")
    assert {module: int(layer) for layer, module, _ in rows} == {m: n for m, n in LAYERS.items() if m != "__init__"}
