"""Benchmarks: `python -m bench` prints, in one run, the ratios the project is judged by."""
