"""How a group's completions become rewards: the reward calls in the sandbox (workers), their
weighted composition (compose) and the LLM judge's pure parts (judging). No torch; the tasks that
use them are `grpo_flyte.reward` and `grpo_flyte.judge`, and the reward functions themselves are
`grpo_flyte.reward_fns`."""
