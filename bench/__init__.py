"""Benchmarks that print one table and write JSON + PNG, with baselines measured side by side in the
same run.

Built in a later issue; see DESIGN.md.
"""
