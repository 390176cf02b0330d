"""Unit tests of grpo_flyte.reporting."""
