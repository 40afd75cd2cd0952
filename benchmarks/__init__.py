"""Benchmarks: `make bench`. Speeds are ratios against a baseline measured in the same run."""
