"""Unit tests of grpo_flyte.config."""
