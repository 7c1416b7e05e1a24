"""Benchmarks: one script per figure, never timed assertions in tests. `python -m bench` lists them."""
