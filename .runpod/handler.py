"""The RunPod Hub's handler entry: runs the worker exactly as `python -m handler` does
(`handler.__main__.main`: the SDK's process first, then the engine's start).

The worker itself is the `handler` package (the image's CMD is `python -m handler`); this file is
where the Hub's publishing guide looks for a handler, and `python .runpod/handler.py [SDK flags]`
works from a clone too.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# This file is named handler.py: its own directory must not shadow the `handler` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
# a clone's root; an installed package is found all the same
sys.path.insert(0, os.path.dirname(_HERE))

from handler.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
