"""This module runs sequence-classification reward models: a folder checked before a run starts, the
model loaded once per process (a bounded cache its callers share), a group's conversations scored
in one batched forward.

A reward model (TRL's `reward_funcs="org/name"`) is `AutoModelForSequenceClassification` with its
own tokenizer. It reads a conversation, the prompt the policy was given and the completion as the
assistant's reply (an episode: every turn), rendered by its own chat template when it has one, else
as the messages' texts separated by blank lines. A model of one output scores a completion with
that output (the logit at the position the model pools, its last token for the decoder models); a
classifier of several labels scores with the probability of the label its reward names
(`<model>@<label>`, grpo_flyte.reward_fns.reward_model_ref): softmax over its logits, or the
label's sigmoid for a multi-label model. One logit of a softmax classifier alone is not a score:
adding a constant to every label's logit changes none of its predictions.

A tokenizer without a pad token pads with its end-of-sequence token, and the model's config is told
so (its pooling finds each row's last token by it), as TRL does for a reward model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_flyte.config.constants import MAX_REWARD_MODELS
from grpo_flyte.runtime.closing_lru import ClosingLRU
from grpo_flyte.runtime.device import load_device, torch_dtype

logger = logging.getLogger(__name__)

Conversation = Sequence[Mapping[str, str]]
# A group's rows go through the model in forwards of at most this many tokens, padding included
# (one forward for a group of 8 completions of 1,024 tokens; a group of long episodes in a few).
BATCH_TOKENS = 16_384
# transformers' model_max_length when a tokenizer names no limit (int(1e30)): not a context.
_NO_LIMIT = 10**7
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
_CLASSIFIER_SUFFIX = "ForSequenceClassification"


def render(tokenizer, conversation: Conversation) -> tuple[str, bool]:
    """The conversation's text as the reward model reads it, and whether its chat template rendered
    it (then the text holds its special tokens already)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in conversation]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False), True
    return "\n\n".join(m["content"] for m in messages), False


def token_ids(tokenizer, conversation: Conversation) -> list[int]:
    text, chat = render(tokenizer, conversation)
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def context_tokens(config, tokenizer) -> int | None:
    """The most tokens the model reads: its config's position limit, else its tokenizer's
    model_max_length when that names one; None when neither does."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _POSITION_FIELDS:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < _NO_LIMIT else None


def label_index(config, label: str | None) -> int | None:
    """The output a reward reads: None for a model of one output (no label named); else the index
    of `label`, a name in the model's id2label or an index. ValueError, in words, otherwise."""
    count = int(config.num_labels)
    names = {str(name): int(i) for i, name in (config.id2label or {}).items()}
    shown = ", ".join(f"{i}={name}" for name, i in sorted(names.items(), key=lambda item: item[1]))
    if label is None:
        if count == 1:
            return None
        raise ValueError(f"the model has {count} labels ({shown}); expected one picked for the reward: '<model>@<label>' by name or index")
    if count == 1:
        raise ValueError(f"the model has one output; '@{label}' picks a label of a classifier of several: leave it out")
    if label in names:
        return names[label]
    if label.isdigit() and int(label) < count:
        return int(label)
    raise ValueError(f"'@{label}' names none of the model's {count} labels; expected one of {shown} (a name or an index)")


def reward_model_problem(model_dir: Path, label: str | None) -> str | None:
    """Why `model_dir` cannot be this reward's model (None: it can), read from its config: a
    sequence-classification model that AutoModelForSequenceClassification loads, and one output or
    a label picked (`label_index`). Its weights and tokenizer are checked as any model folder's."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 -- an unknown model type, a broken config.json: one line
        return f"its config.json cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    architectures = list(config.architectures or [])
    if not any(a.endswith(_CLASSIFIER_SUFFIX) for a in architectures):
        named = ", ".join(architectures) or "none named"
        return (
            f"its architecture ({named}) is not a sequence-classification model; expected a reward model "
            f"(AutoModelForSequenceClassification's, e.g. Llama{_CLASSIFIER_SUFFIX}): a causal language model has no score head"
        )
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        return f"model type {config.model_type!r} has no sequence-classification class in transformers"
    try:
        label_index(config, label)
    except ValueError as exc:
        return str(exc)
    return None


def model_context(model_dir: Path, tokenizer) -> int | None:
    """`context_tokens` of a model folder, read from its config alone."""
    from transformers import AutoConfig

    return context_tokens(AutoConfig.from_pretrained(model_dir), tokenizer)


@dataclass(frozen=True)
class RewardModelKey:
    """What a loaded reward model is made from (its labels are read per call: one load serves them all)."""

    model_path: str
    dtype: str


class RewardModel:
    """A loaded reward model and its tokenizer, on this process's device."""

    def __init__(self, key: RewardModelKey):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        logger.info("loading the reward model %s (once per replica)", key.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(key.model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            key.model_path, dtype=torch_dtype(key.dtype), device_map={"": load_device()}
        ).eval()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.context = context_tokens(self.model.config, self.tokenizer)
        self.multi_label = self.model.config.problem_type == "multi_label_classification"

    def score(self, conversations: Sequence[Conversation], label: str | None = None) -> list[float]:
        """Each conversation's score (see the module's docstring), in forwards of at most
        BATCH_TOKENS tokens; a conversation longer than the model's context keeps its last tokens
        (the completion's end)."""
        import torch

        index = label_index(self.model.config, label)
        rows = [token_ids(self.tokenizer, c) for c in conversations]
        if self.context is not None:
            rows = [ids[-self.context :] for ids in rows]
        scores: list[float] = []
        for chunk in _chunks(rows, BATCH_TOKENS):
            width = max(len(ids) for ids in chunk)
            pad = self.tokenizer.pad_token_id
            input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in chunk])
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in chunk])
            device = self.model.device
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits.float()
            if index is None:
                values = logits[:, 0]
            elif self.multi_label:
                values = logits[:, index].sigmoid()
            else:
                values = logits.softmax(-1)[:, index]
            scores.extend(values.cpu().tolist())
        return scores

    def close(self) -> None:
        import torch

        del self.model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _chunks(rows: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Consecutive rows in chunks whose padded size (rows x the longest) stays within `budget`
    tokens; a row longer than the budget is a chunk of its own."""
    chunks: list[list[list[int]]] = []
    for ids in rows:
        if chunks and (len(chunks[-1]) + 1) * max(len(ids), *map(len, chunks[-1])) <= budget:
            chunks[-1].append(ids)
        else:
            chunks.append([ids])
    return chunks


class RewardModelCache(ClosingLRU[RewardModelKey, "RewardModel"]):
    """A process's loaded reward models, one per key, loaded on first use; past `capacity` the
    least recently used is freed before the next loads (a run names at most MAX_REWARD_MODELS,
    which the config checks, so a run never reloads one). A local run's callers share one copy, as
    a replica's concurrent calls do."""

    @property
    def models(self) -> OrderedDict[RewardModelKey, RewardModel]:
        return self.held

    def get(self, key: RewardModelKey) -> RewardModel:  # type: ignore[override]
        return super().get(key, lambda: RewardModel(key))

    def describe(self, key: RewardModelKey) -> str:
        return f"the reward model {key.model_path}"


_models = RewardModelCache(MAX_REWARD_MODELS)


def get_reward_model(key: RewardModelKey) -> RewardModel:
    """This process's reward model for `key` (call on the torch thread)."""
    return _models.get(key)
