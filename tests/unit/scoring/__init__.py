"""Unit tests of grpo_flyte.scoring."""
