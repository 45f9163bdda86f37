"""The project's performance suite: `python -m benchmarks` runs every benchmark and prints one table."""
