"""Unit tests of grpo_flyte.launch."""
