"""Queue-depth autoscaling: the pure policy, the RunPod controller, the local endpoint, the trace
simulator.

`policy` (observed state -> desired workers) is shared by `controller` (a RunPod endpoint through
`runpod_api`), `endpoint/` (a local emulator with real worker processes) and `sim/` (trace replay).
Speaks HTTP to workers; imports nothing else of ours.
"""
