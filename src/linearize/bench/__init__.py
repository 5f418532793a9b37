"""Benchmarks: commands that print figures (speed and memory targets live here, not in tests)."""
