"""The README and docs/ are the contract: their config table, commands, code and links must match the code."""

import re
from pathlib import Path

from grpo_flyte.config.table import config_table_markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_config_table_is_generated_from_runconfig():
    assert config_table_markdown() in (DOCS / "configuration.md").read_text()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert "make test" in readme and "make demo" in readme
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci_lines


def test_the_readme_is_a_front_door_that_links_every_page():
    """Under 250 lines; each page of docs/ is one link away from it."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    linked = {target.split("#", 1)[0] for target in re.findall(r"\]\((docs/[^)\s]+)\)", text)}
    assert {f"docs/{page.name}" for page in DOCS.glob("*.md")} <= linked


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (backticks, colons, commas,
    parentheses), each space a dash."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in a markdown page, outside fenced code; repeats get -1, -2, ..."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchor, n = github_anchor(m.group(1)), 0
            while (f"{anchor}-{n}" if n else anchor) in found:
                n += 1
            found.add(f"{anchor}-{n}" if n else anchor)
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's markdown links and images that are not web addresses, outside fenced code."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.DOTALL | re.MULTILINE)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_in_the_readme_and_docs_reaches_its_file_and_heading():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_the_readme_python_example_runs(tmp_path):
    """The first screen's Python block, run as a user would paste it (the embedded model, Flyte
    local mode): it prints the final held-out reward and the adapter's folder. As `python -c BLOCK`
    (a warm one: tests/support/warm_python.py)."""
    from tests.support import warm_python

    text = (ROOT / "README.md").read_text()
    block = text.split("**From Python**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    proc = warm_python.run(["-c", block], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reward, adapter = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert 0.0 <= float(reward) <= 1.2 and (Path(adapter) / "adapter_model.safetensors").is_file()


def test_the_documented_custom_environment_is_complete_short_and_plays(tmp_path, monkeypatch, embedded_dir):
    """docs/rewards-and-environments.md's own environment, saved as a user would: under 30 lines,
    it loads by module:Class and plays an episode (a tool call, the tool's answer, the end)."""
    import asyncio

    from transformers import AutoTokenizer

    from grpo_flyte.engine.episodes import Budgets, Splicer, new_environment, run_episode
    from grpo_flyte.multiturn import load_environment
    from grpo_flyte.types import Example, Rollout

    text = (DOCS / "rewards-and-environments.md").read_text()
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


def test_the_module_map_follows_the_tree_room_by_room():
    """docs/architecture.md's map names every module of the package once, top to bottom: the rooms
    in tests/repo/test_layers.py's layers, and inside a package its modules in their order there."""
    from tests.repo.test_layers import INSIDE, LAYERS, PACKAGE

    text = (DOCS / "architecture.md").read_text()
    block = text.split("module                     its job\n", 1)[1].split("```", 1)[0]
    rows = [
        line.split(maxsplit=1) for line in block.strip().splitlines() if line.strip() and not line.startswith("#")
    ]  # "#": a room's heading
    assert all(len(row) == 2 for row in rows)  # a module's path, its job
    expected = []
    for layer in reversed(LAYERS):
        for room in reversed(layer):
            if room == "__init__":
                continue
            if room in INSIDE:
                expected += [f"{room}/{module}.py" for module in reversed(INSIDE[room])]
            else:
                expected.append(f"{room}.py")
    assert [path for path, _ in rows] == expected
    on_disk = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert set(expected) == on_disk


def test_the_default_prices_are_the_ones_docs_cluster_md_sources():
    """Each default of --prices is a row of docs/cluster.md's price table with the same figure, and
    the table has no row the code lacks: the table is where each figure's source and date are."""
    from grpo_flyte.config.constants import LIST_PRICES

    text = (DOCS / "cluster.md").read_text()
    table = text.split("| type | default $/hour |", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"^\| `([^`]+)` \| ([0-9.]+) \|", table, flags=re.M))
    assert {name: float(value) for name, value in rows.items()} == LIST_PRICES
