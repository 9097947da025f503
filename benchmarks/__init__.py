"""Benchmarks: `python -m benchmarks` (or `make bench`). Never part of the test run."""
