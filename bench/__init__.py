"""Benchmarks: ratios measured side by side in one run. Results in docs/benchmarks.md."""
