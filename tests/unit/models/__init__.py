"""Tests of grpo_flyte.models."""
