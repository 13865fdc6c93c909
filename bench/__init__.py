"""Benchmark scripts (see bench/README.md). A package so that tests can import a script's
functions (`from bench import soak`); the scripts themselves run as `python bench/NAME.py`."""
