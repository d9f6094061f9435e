"""Triton's own settings for this process, chosen before its first import: two lookups Triton would
otherwise make at a start, each answered here from what the start already knows.

- `TRITON_BACKENDS_IN_TREE=1`: Triton finds its backends in its own package instead of reading the
  entry points of every installed distribution (`importlib.metadata`), inside `import triton`.
  Coldbrew runs the NVIDIA backend that ships in the package.
- `TRITON_LIBCUDA_PATH`: the directory of the CUDA driver library this process loaded
  (cache.cuda_driver), instead of `ldconfig -p` in a subprocess at the first kernel launch. Triton
  links the C helpers it builds against it, as it would against what ldconfig lists.

A value the environment already sets is left as it is. Child processes (Triton's compiler key, the
background kernel warm-up) inherit the settings. Imports no torch and no Triton.
"""

from __future__ import annotations

import os

from cache import cuda_driver, start_pages

IN_TREE = "TRITON_BACKENDS_IN_TREE"
LIBCUDA_PATH = "TRITON_LIBCUDA_PATH"


def apply(environ: dict | None = None) -> dict[str, str]:
    """Set what the environment leaves unset (os.environ, or `environ`); returns what was set."""
    env = os.environ if environ is None else environ
    set_now = {}
    if not env.get(IN_TREE):
        set_now[IN_TREE] = "1"
    if not env.get(LIBCUDA_PATH) and cuda_driver.load():
        folder = driver_dir()
        if folder is not None:
            set_now[LIBCUDA_PATH] = folder
    env.update(set_now)
    return set_now


def driver_dir(maps: str = "/proc/self/maps") -> str | None:
    """The directory of the first `libcuda.so*` file this process maps (`maps`: another such
    listing) that holds `libcuda.so.1`, as Triton wants it; None if there is none."""
    for *_, path in start_pages.file_mappings(maps):
        if os.path.basename(path).startswith("libcuda.so"):
            folder = os.path.dirname(path)
            if os.path.exists(os.path.join(folder, "libcuda.so.1")):
                return folder
    return None
