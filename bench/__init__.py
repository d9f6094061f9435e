"""Benchmarks that print one table and write JSON + PNG, with baselines measured side by side in the
same run.

The runnable ones answer `python -m bench.NAME --help`; bench/results/ keeps every run (its README
indexes them) and docs/performance.md the current figures.
"""
