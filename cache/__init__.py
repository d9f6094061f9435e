"""The snapshotted model cache: sources -> immutable snapshots -> packed weights -> streaming
loader.

`resolve(ref)` turns a model reference into a local snapshot directory. Imports nothing of ours.
"""

from __future__ import annotations

from cache.resolver import resolve

__all__ = ["resolve"]
