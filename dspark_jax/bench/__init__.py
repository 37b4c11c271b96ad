"""Measurement libraries shared by the benchmark programs (benchmarks/) and their tests."""
