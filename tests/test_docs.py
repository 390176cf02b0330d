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
    local mode): it prints the final held-out reward and the adapter's folder."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    block = text.split("**From Python**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reward, adapter = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert 0.0 <= float(reward) <= 1.2 and (Path(adapter) / "adapter_model.safetensors").is_file()
