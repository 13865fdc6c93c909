"""The device side of programmatic dependent launch (kernels/pdl.py says when it is on): the
griddepcontrol calls, here so that every kernel module reaches them through one module
(Triton's interpreter cannot run them; tests replace them here with recorders)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["gdc_launch_dependents", "gdc_wait", "start"]


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's first statement where it reads nothing it could load before its wait: the
    next kernel may launch now (it waits for this one before it reads anything this one
    writes), and this one waits for the kernel before it, before any access."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
