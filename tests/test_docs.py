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
