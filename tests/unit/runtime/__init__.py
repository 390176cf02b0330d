"""Unit tests of grpo_flyte.runtime."""
