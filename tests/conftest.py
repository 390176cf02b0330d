"""Shared fixtures: a tiny random Llama with the embedded model's tokenizer, for fast local runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import warm_python


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from grpo_flyte.models import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A 2-layer, 32-wide random Llama that shares SmolLM2's tokenizer and chat template."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), embedded_dir)


@pytest.fixture
def jsonl_dataset(tmp_path) -> Path:
    rows = [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 7)]]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pytest_sessionfinish(session, exitstatus):
    warm_python.close()
