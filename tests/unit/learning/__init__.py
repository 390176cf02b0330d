"""Unit tests of grpo_flyte.learning."""
