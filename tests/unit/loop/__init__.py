"""Unit tests of grpo_flyte.loop."""
