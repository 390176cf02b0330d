"""This package turns a group's completions into rewards: the reward calls in the sandbox
(`scoring.workers`), their weighted composition (`scoring.compose`) and the LLM judge's pure parts
(`scoring.judging`). No torch; the tasks that use them are `grpo_flyte.reward` and
`grpo_flyte.judge`, and the reward functions themselves are `grpo_flyte.reward_fns`."""
