"""This module renders a dataset row as the text the model sees, and as its token ids.

A row without a TRL `prompt` gets the run's prompt around its question (`prompt_format` 'chat':
the system prompt and the question with the answer instruction through the chat template; 'plain':
a question/answer frame). A TRL row's prompt is used as given: text as it is, chat messages through
the chat template. The generator tokenizes here, once; the trainer reuses those ids.
"""

from __future__ import annotations

from grpo_flyte.config.constants import ANSWER_INSTRUCTION, SYSTEM_PROMPT
from grpo_flyte.config.generation import PromptConfig
from grpo_flyte.types import Example, Message

# The prompt wording is configurable (--system-prompt, --answer-instruction); defaults in config/constants.py.
PLAIN_TEMPLATE = "Question: {question}\n{instruction}\nAnswer:"


def render_prompt(
    question: str,
    prompt_format: str,
    tokenizer,
    template_kwargs: dict | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    instruction: str = ANSWER_INSTRUCTION,
) -> str:
    """The prompt text for one question; token ids come from the generator's tokenizer.

    The instruction follows the question; `template_kwargs` (PromptConfig.template_kwargs: the
    chat_template_kwargs and the enable_thinking switch) go to the chat template. An empty system
    prompt or instruction is left out.
    """
    if prompt_format == "plain":
        return _plain(question, instruction)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt_format='chat' but the model's tokenizer has no chat template: use prompt_format='plain'")
    return _chat(tokenizer, _chat_messages(question, system_prompt, instruction), template_kwargs)


def _plain(question: str, instruction: str) -> str:
    return PLAIN_TEMPLATE.format(question=question, instruction=instruction) if instruction else f"Question: {question}\nAnswer:"


def _chat_messages(question: str, system_prompt: str, instruction: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": f"{question} {instruction}".strip()})
    return messages


def prompt_messages(example: Example, prompt: PromptConfig) -> list[dict[str, str]]:
    """The prompt the policy was given, as chat messages (what a reward model reads before the
    completion): a TRL row's messages as they are, its text as one user message; else the chat
    format's system prompt and question with the instruction, or the plain format's text as one
    user message."""
    if example.prompt is not None:
        return (
            [{"role": "user", "content": example.prompt}] if isinstance(example.prompt, str) else [m.model_dump() for m in example.prompt]
        )
    if prompt.prompt_format == "plain":
        return [{"role": "user", "content": _plain(example.question, prompt.answer_instruction)}]
    return _chat_messages(example.question, prompt.system_prompt, prompt.answer_instruction)


def _chat(tokenizer, messages: list[dict[str, str]], template_kwargs: dict | None) -> str:
    """The chat template applied with the assistant's turn opened, given `template_kwargs`."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))


def render_trl_prompt(prompt: str | list[Message], tokenizer, template_kwargs: dict | None = None) -> str:
    """A prompt in TRL's format: text is used as it is; chat messages go through the chat template
    with the assistant's turn opened (the run's system prompt and instruction are not added)."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the dataset's prompts are chat messages but the model's tokenizer has no chat template")
    return _chat(tokenizer, [m.model_dump() for m in prompt], template_kwargs)


def is_chat(example: Example, prompt: PromptConfig) -> bool:
    """Whether the example's prompt went through the chat template (so replies are chat turns)."""
    return prompt.prompt_format == "chat" if example.prompt is None else not isinstance(example.prompt, str)


def tokenize_prompt(tokenizer, example: Example, prompt: PromptConfig) -> list[int]:
    if example.prompt is None:
        text = render_prompt(
            example.question, prompt.prompt_format, tokenizer, prompt.template_kwargs, prompt.system_prompt, prompt.answer_instruction
        )
    else:  # TRL's format: text as it is, chat messages through the chat template
        text = render_trl_prompt(example.prompt, tokenizer, prompt.template_kwargs)
    # The chat template already wrote the special tokens; other text gets the tokenizer's.
    ids = tokenizer(text, add_special_tokens=not is_chat(example, prompt))["input_ids"]
    if len(ids) > prompt.max_prompt_tokens:
        if prompt.overlong_prompts == "truncate":
            return list(ids[-prompt.max_prompt_tokens :])  # the end holds the question and the turn's start
        raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prompt_tokens={prompt.max_prompt_tokens}: {example.question[:80]!r}")
    return list(ids)


# A token covers at least one byte of the text it was cut from (byte-level BPE, SentencePiece
# with byte fallback); the slack covers tokens added outside the text (BOS, a leading-space marker).
_TOKEN_SLACK = 4


def overlong_prompts(tokenizer, examples: list[Example], prompt: PromptConfig) -> dict[int, int]:
    """{index: length in tokens} of the examples whose prompt is longer than max_prompt_tokens.

    Tokenizing every prompt of a large dataset takes seconds, so a prompt is tokenized only when
    its UTF-8 size (which no token count exceeds, plus a little slack) is over the limit; for a
    question that size is that of the prompt rendered around an empty question plus the question's.
    """
    limit = prompt.max_prompt_tokens
    untruncated = prompt.model_copy(update={"max_prompt_tokens": 1 << 30})
    frame: int | None = None
    found = {}
    for i, example in enumerate(examples):
        if example.prompt is None:
            if frame is None:
                empty = render_prompt(
                    "", prompt.prompt_format, tokenizer, prompt.template_kwargs, prompt.system_prompt, prompt.answer_instruction
                )
                frame = len(empty.encode()) + 1  # the space between question and instruction
            bound = frame + len(example.question.encode())
        else:
            bound = len(render_trl_prompt(example.prompt, tokenizer, prompt.template_kwargs).encode())
        if bound + _TOKEN_SLACK > limit:
            length = len(tokenize_prompt(tokenizer, example, untruncated))
            if length > limit:
                found[i] = length
    return found
