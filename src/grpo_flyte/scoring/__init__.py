"""How a group's completions become rewards: the weighted composition of reward functions and the
LLM judge's pure parts (its prompt, its reply, its scores). No Flyte, no torch; the tasks that
use them are `grpo_flyte.reward` and `grpo_flyte.judge`."""
