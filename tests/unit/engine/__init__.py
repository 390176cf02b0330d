"""Unit tests of grpo_flyte.engine."""
