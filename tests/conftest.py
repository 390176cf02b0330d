"""Shared fixtures: a tiny random Llama with the embedded model's tokenizer, for fast local runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def _share_the_cpus() -> None:
    """Under pytest-xdist (`-n 2` in pyproject.toml) each worker process runs its tests beside the
    others': torch in each, and in every process a test starts (warm pythons, drills, pods: they
    inherit this environment), gets the CPUs divided among the workers. Set before anything
    imports torch, which reads it once. Two processes of 2 OpenMP threads on 2 cores wait on each
    other's spinning threads many times over. An OMP_NUM_THREADS of the caller's is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # set by xdist in each worker
    if workers:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus // workers)))


_share_the_cpus()

from tests.support import warm_python  # noqa: E402 (imports no torch, but after the setting all the same)


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from grpo_flyte.models.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> Path:
    """A 2-layer, 32-wide random Llama that shares SmolLM2's tokenizer and chat template."""
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), embedded_dir)


@pytest.fixture(scope="module")
def llama32_dir(tmp_path_factory, embedded_dir):
    """A one-layer random Llama whose linear layers all have a multiple of 32 output features, as
    bitsandbytes' CPU kernel packs them (released models all do; see models._not_4bit): the 4-bit tests'."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("llama32")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(embedded_dir).save_pretrained(path)  # a merged model is saved with one
    return path


@pytest.fixture
def jsonl_dataset(tmp_path) -> Path:
    rows = [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 7)]]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# The modules whose tests one pytest-xdist worker runs together, and why, by their paths in the node
# ids (relative to the checkout's root, pytest's rootdir); every other test goes to whichever worker
# is free (`--dist loadgroup` in pyproject.toml).
ONE_WORKER = {
    "tests/e2e/test_vllm_contract.py": "two vLLM engines (module fixtures, 40 s and GBs of memory each; vLLM refuses to start "
    "when too little memory is free): each built once, and never two at once",
    "tests/e2e/test_pod_rehearsal.py": "the submission, the image and the first adapter (module fixtures, a fresh process each) made once",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with ONE_WORKER's modules as its groups. pytest-xdist's own grouping
    (`xdist_group` marks) groups nothing on pytest 9.2: it renames the tests' node ids, which
    pytest 9.2 no longer lets it do (pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ByModuleOrTest(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER else super()._split_scope(nodeid)

    return ByModuleOrTest(config, log)


def pytest_sessionfinish(session, exitstatus):
    warm_python.close()
