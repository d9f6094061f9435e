"""Queue-depth autoscaling: the pure policy, the RunPod controller, the local endpoint, the trace simulator.

Built in a later issue; see DESIGN.md. Speaks HTTP to workers; imports nothing of ours.
"""
