"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
kernel before it in the stream drains, and waits (griddepcontrol.wait) before it touches anything
that kernel or an earlier one wrote. Batch-1 decode is a chain of a few hundred short kernels, each
of which would otherwise pay its launch and its first memory round trip after its predecessor's
last program has finished; with it, the next kernel's programs are resident and its first weight
tile is in flight by then.

The contract of a kernel that takes it (a `PDL: tl.constexpr` argument):
- before `release(PDL)` it reads only what no kernel writes (weights), and writes nothing;
- `release(PDL)` waits for the kernels before it, then lets the next one launch; every program
  reaches it, an early return included, so this kernel's completion implies its predecessors'.
Kernels launched without it (torch's, cuBLAS's) are ordered as usual; a PDL launch after them
waits for their completion as it would anyway.

`launch_options()` gives the kernel argument and the launch option together, for the target
Triton compiles for (warmup.aot's named target on a GPU-less build): on for sm_90 and later, off
below (griddepcontrol does not exist there) and when ENABLED is False (benchmarks compare both).
"""

from __future__ import annotations

try:  # a CPU-only install may have no triton; nothing here runs then
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = release = None

ENABLED = True  # benchmarks turn it off to measure what it buys
MIN_CAPABILITY = 90  # griddepcontrol: sm_90 and later
_ON: list[tuple[object, bool]] = [(None, False)]  # (the Triton driver last asked, its answer)


def target_supports(backend: str, arch: int | str) -> bool:
    """Whether a Triton target runs programmatic dependent launch (CUDA, sm_90 or later)."""
    return backend == "cuda" and isinstance(arch, int) and arch >= MIN_CAPABILITY


def launch_options(wanted: bool = True) -> dict:
    """{"PDL": on, "launch_pdl": on} for the active Triton target: pass both to a kernel launch
    (wanted=False: this launch is ordered as usual)."""
    if not (ENABLED and wanted) or triton is None:
        return {"PDL": False, "launch_pdl": False}
    try:
        active = triton.runtime.driver.active  # warmup.aot swaps in a named target's stand-in
    except RuntimeError:  # no driver: Triton's interpreter (CPU tests) launches nothing
        return {"PDL": False, "launch_pdl": False}
    asked, on = _ON[0]
    if asked is not active:
        target = active.get_current_target()
        on = target_supports(target.backend, target.arch)
        _ON[0] = (active, on)
    return {"PDL": on, "launch_pdl": on}


if triton is not None:

    @triton.jit
    def release(PDL: tl.constexpr):
        """Wait for the kernels before this one (their writes visible after), then let the next
        kernel launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
