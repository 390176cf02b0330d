"""Tests of grpo_flyte.tools: schemas, tool-call formats, calls in the sandbox."""
