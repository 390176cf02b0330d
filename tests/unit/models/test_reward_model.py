"""A sequence-classification reward model: a group's scores against a direct forward of each
conversation alone, a classifier's label, the checks of a folder, the batching, the bounded cache."""

from __future__ import annotations

import pytest

from grpo_flyte.models import reward_model
from grpo_flyte.models.reward_model import RewardModelCache, RewardModelKey, _chunks, label_index, reward_model_problem, token_ids
from tests.support.tiny_model import build_tiny_reward_model

CONVERSATIONS = [
    [{"role": "user", "content": "What is 13 + 14?"}, {"role": "assistant", "content": "27"}],
    [{"role": "user", "content": "What is 13 + 14?"}, {"role": "assistant", "content": "It is 13 + 14 = 26, I think.\n#### 26"}],
    # an episode: the model's turns and the environment's
    [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "What is 13 + 14?"},
        {"role": "assistant", "content": "<calc>13+14</calc>"},
        {"role": "user", "content": "27"},
        {"role": "assistant", "content": "#### 27"},
    ],
]


@pytest.fixture(scope="module")
def one_output(tmp_path_factory, embedded_dir):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"), embedded_dir)


@pytest.fixture(scope="module")
def two_labels(tmp_path_factory, embedded_dir):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm2"), embedded_dir, num_labels=2)


def _direct(folder, conversation):
    """The model's logits for one conversation alone: no padding, no batch."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    with torch.inference_mode():
        return model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0]


def test_a_groups_scores_in_one_padded_forward_equal_each_conversations_own_forward(one_output, monkeypatch):
    forwards = []
    model = reward_model.RewardModel(RewardModelKey(str(one_output), "float32"))
    forward = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda **kw: forwards.append(kw["input_ids"].shape) or forward(**kw))
    scores = model.score(CONVERSATIONS)
    lengths = [len(token_ids(model.tokenizer, c)) for c in CONVERSATIONS]
    assert forwards == [(3, max(lengths))] and len(set(lengths)) == 3  # one forward, rows of three lengths padded
    assert scores == pytest.approx([_direct(one_output, c)[0].item() for c in CONVERSATIONS], abs=1e-5)
    assert len(set(scores)) == 3


def test_a_classifiers_score_is_its_labels_probability_by_name_or_index(two_labels):
    model = reward_model.RewardModel(RewardModelKey(str(two_labels), "float32"))
    expected = [_direct(two_labels, c).softmax(-1)[1].item() for c in CONVERSATIONS]
    assert model.score(CONVERSATIONS, "right") == pytest.approx(expected, abs=1e-6)
    assert model.score(CONVERSATIONS, "1") == pytest.approx(expected, abs=1e-6)
    assert model.score(CONVERSATIONS, "wrong") == pytest.approx([1 - p for p in expected], abs=1e-6)


def test_a_conversation_longer_than_the_context_keeps_its_last_tokens(tmp_path, embedded_dir):
    folder = build_tiny_reward_model(tmp_path / "short", embedded_dir, max_positions=40)
    model = reward_model.RewardModel(RewardModelKey(str(folder), "float32"))
    long = [{"role": "user", "content": "What is 13 + 14? " * 20}, {"role": "assistant", "content": "#### 27"}]
    ids = token_ids(model.tokenizer, long)
    assert len(ids) > 40 and model.context == 40
    import torch

    with torch.inference_mode():
        direct = model.model(input_ids=torch.tensor([ids[-40:]])).logits[0, 0].item()
    assert model.score([long]) == pytest.approx([direct], abs=1e-6)


def test_the_label_a_reward_reads():
    from transformers import LlamaConfig

    one = LlamaConfig(num_labels=1)
    two = LlamaConfig(id2label={0: "wrong", 1: "right"}, label2id={"wrong": 0, "right": 1})
    assert (label_index(one, None), label_index(two, "right"), label_index(two, "0")) == (None, 1, 0)
    with pytest.raises(
        ValueError, match=r"the model has 2 labels \(0=wrong, 1=right\); expected one picked for the reward: '<model>@<label>'"
    ):
        label_index(two, None)
    with pytest.raises(ValueError, match="'@maybe' names none of the model's 2 labels; expected one of 0=wrong, 1=right"):
        label_index(two, "maybe")
    with pytest.raises(ValueError, match="'@2' names none"):
        label_index(two, "2")
    with pytest.raises(ValueError, match="the model has one output; '@right' picks a label of a classifier of several"):
        label_index(one, "right")


def test_a_folder_that_is_no_reward_model_is_named_so(one_output, two_labels, tiny_model_dir):
    assert reward_model_problem(one_output, None) is None and reward_model_problem(two_labels, "right") is None
    problem = reward_model_problem(tiny_model_dir, None)
    assert problem.startswith("its architecture (LlamaForCausalLM) is not a sequence-classification model"), problem
    assert "the model has 2 labels" in reward_model_problem(two_labels, None)


def test_rows_are_chunked_within_the_token_budget():
    rows = [[0] * 3, [0] * 5, [0] * 2, [0] * 9, [0] * 1]
    # padded size = rows x the longest: 3,5 -> 10; +2 -> 15 > 12; 2 alone; +9 -> 18 > 12; 9 alone (over: alone); +1 -> 18
    assert [[len(r) for r in c] for c in _chunks(rows, 12)] == [[3, 5], [2], [9], [1]]
    assert [[len(r) for r in c] for c in _chunks(rows, 100)] == [[3, 5, 2, 9, 1]]


def test_the_cache_holds_one_loaded_copy_per_model_and_frees_the_least_recently_used(one_output, two_labels, monkeypatch):
    loads, freed = [], []

    class Fake:
        def __init__(self, key):
            loads.append(key.model_path)
            self.key = key

        def close(self):
            freed.append(self.key.model_path)

    monkeypatch.setattr(reward_model, "RewardModel", Fake)
    cache = RewardModelCache(2)
    a, b, c = (RewardModelKey(p, "float32") for p in ("a", "b", "c"))
    first = cache.get(a)
    assert cache.get(a) is first  # shared by every caller
    cache.get(b)
    cache.get(a)  # a is now the most recently used
    cache.get(c)
    assert loads == ["a", "b", "c"] and freed == ["b"] and list(cache.models) == [a, c]
