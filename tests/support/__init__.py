"""Test helpers shared by the tiers and the benchmarks."""
