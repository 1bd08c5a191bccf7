"""Benchmark smoke runs and the package's rooms."""
