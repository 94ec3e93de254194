"""Benchmark harness: methods side by side in one process."""
