"""The snapshotted model cache: sources -> immutable snapshots -> packed weights -> streaming loader.

Built in a later issue; see DESIGN.md. Imports nothing of ours.
"""
