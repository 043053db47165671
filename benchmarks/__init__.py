"""Measured comparisons (not tests); see docs/benchmarks.md. ``benchmarks.models`` holds the benchmark models."""
