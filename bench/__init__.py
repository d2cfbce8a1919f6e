"""Benchmarks: simulator fidelity, trace replay and policy comparisons."""
