"""grpo_flyte.loop.batches: the engine settings the generate and judge tasks get (an iteration's
batch itself is exercised by the local runs of tests/unit/test_driver.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_flyte.config.errors import make_config
from grpo_flyte.loop.batches import engine_settings, local_vllm_share

CARD_GB = 24.0  # an RTX 4090 / A10G / L4-class card


def test_a_local_run_splits_a_24_gb_card_between_the_vllm_engines_and_the_trainer():
    """vLLM reserved 0.85 of the card in a local run (20.4 GB of 24), and the trainer beside it in
    the same process ran out of memory at its first step. Now the engines together reserve half of
    --vllm-memory-fraction and the trainer keeps the rest, with the judge's engine or without."""
    alone = local_vllm_share(0.85, judging=False)
    assert alone * CARD_GB == pytest.approx(10.2)  # 0.85 x 0.5 x 24
    assert (1 - alone) * CARD_GB == pytest.approx(13.8)
    each = local_vllm_share(0.85, judging=True)
    assert each * CARD_GB == pytest.approx(5.1)  # the generate and the judge engines: 0.85 x 0.5 / 2 x 24 each
    assert (1 - 2 * each) * CARD_GB == pytest.approx(13.8)
    assert local_vllm_share(0.98, judging=False) * CARD_GB == pytest.approx(11.76)  # the field's largest value: 0.49 of the card


def test_the_split_applies_outside_a_cluster_only(monkeypatch):
    import flyte

    config = make_config(vllm_memory_fraction=0.8)
    judged = make_config(vllm_memory_fraction=0.8, rewards={"judge": 1.0}, judge_model="tiny")
    monkeypatch.setattr(flyte, "ctx", lambda: SimpleNamespace(mode="local"))
    assert engine_settings(config).vllm_memory_fraction == pytest.approx(0.4)
    assert engine_settings(judged).vllm_memory_fraction == pytest.approx(0.2)
    assert engine_settings(config).model_copy(update={"vllm_memory_fraction": 0.8}) == config.engine  # nothing else changes
    monkeypatch.setattr(flyte, "ctx", lambda: SimpleNamespace(mode="remote"))  # a cluster's pool: a GPU of its own
    assert engine_settings(config) == config.engine and engine_settings(judged) == judged.engine
