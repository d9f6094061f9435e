"""Triton's own settings for this process, chosen before its first import: two lookups Triton would
otherwise make at a start, each answered here from what the start already knows.

- `TRITON_BACKENDS_IN_TREE=1`: Triton finds its backends in its own package instead of reading the
  entry points of every installed distribution (`importlib.metadata`), inside `import triton`.
  Coldbrew runs the NVIDIA backend that ships in the package.
- `TRITON_LIBCUDA_PATH`: the directory of the CUDA driver library this process already loaded
  (cache.cuda_driver), instead of `ldconfig -p` in a subprocess at the first kernel launch. Triton
  links the C helpers it builds against it, as it would against what ldconfig lists.

A value the environment already sets is left as it is. Child processes (Triton's compiler key, the
background kernel warm-up) inherit the settings. Imports no torch and no Triton.
"""

from __future__ import annotations

import os

from cache import cuda_driver

IN_TREE = "TRITON_BACKENDS_IN_TREE"
LIBCUDA_PATH = "TRITON_LIBCUDA_PATH"


def apply(environ: dict | None = None) -> dict[str, str]:
    """Set what the environment leaves unset (os.environ, or `environ`); returns what was set."""
    env = os.environ if environ is None else environ
    chosen = {IN_TREE: "1"}
    driver_dir = cuda_driver.library_dir()
    if driver_dir is not None:
        chosen[LIBCUDA_PATH] = driver_dir
    set_now = {k: v for k, v in chosen.items() if not env.get(k)}
    env.update(set_now)
    return set_now
