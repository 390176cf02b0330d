"""This package makes plain Python functions tools a model calls through its chat template
(`--tools module:fn,...`, TRL's `tools=`): each function's JSON schema (`tools.functions`), the
tool-call formats of chat templates and their parsing (`tools.formats`), and a call run in the
sandbox with a time limit (`tools.execution`). No torch; the episodes that use them are
`grpo_flyte.engine.tool_episodes`."""
