"""`python -m scaling.simulate [--out DIR] [--quick]`: the trace simulator's command, kept at this
path; the simulator itself is the scaling.sim package.

`main` runs the command; `load_results` reads back the results.json it writes.
"""

from scaling.sim.cli import main
from scaling.sim.report import load_results

__all__ = ["load_results", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
