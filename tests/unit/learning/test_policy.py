"""The trained policy's model: TRL's disable_dropout."""

from __future__ import annotations

import pytest

from grpo_flyte.config.errors import make_config
from grpo_flyte.errors import ConfigError
from grpo_flyte.learning.policy import _without_dropout


def test_disable_dropout_switches_off_every_dropout_layer():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Sequential(torch.nn.Dropout(0.1)))
    model.train()
    x = torch.ones(64, 4)
    assert not torch.equal(model(x), model(x))  # dropout draws differ between passes
    _without_dropout(model)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.0, 0.0]
    assert torch.equal(model(x), model(x))


def test_disable_dropout_with_lora_dropout_is_refused():
    with pytest.raises(ConfigError, match=r"--disable-dropout with --lora-dropout 0.1: expected --lora-dropout 0"):
        make_config(disable_dropout=True, lora_dropout=0.1)
    assert make_config(disable_dropout=True).lora.disable_dropout
