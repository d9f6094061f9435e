"""Ahead-of-time work: snapshots and per-architecture compiled engines, and start-time warm-up.

Built in a later issue; see DESIGN.md.
"""
