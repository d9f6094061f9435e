"""The worker's start and what makes it fast: the one start sequence (a model reference -> a running
engine, each phase timed), tensor-parallel ranks, and compiled engines (`python -m warmup build`:
the Triton kernels compiled ahead of time for each GPU architecture, installed at start, loaded in
the background once the first request is served and shared with the fleet).

Imports engine and cache. docs/architecture.md lists its modules; docs/cold-start.md and
docs/compiled-engines.md say how they work.
"""
