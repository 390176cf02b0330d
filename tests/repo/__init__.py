"""Checks of the repository itself: import layers, docs, benchmarks, the task image, the test helpers."""
