"""Unit tests, one folder per package of src/grpo_flyte; the top-level modules' tests directly here."""
