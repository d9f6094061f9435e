"""The trace simulator: Azure LLM traces replayed against a worker model read from a serving
benchmark, under scaling.policy and the baseline autoscalers, billed per worker.

Rooms: `traces` (the arrival processes), `worker_model` (one worker's capacity and speed),
`replay` (the event loop of one run), `baselines` (the other autoscalers), `sweep` (knobs, best
settings, verdicts), `report` and `plot` (outputs), `cli` (`python -m scaling.simulate`).
"""
