"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels (Hopper+).

A decode step of a few rows is a chain of short kernels (quantize, FP8 product, rotary, K/V
write, attention, quantize, ...), and each product pays a fixed start-up before its weights
stream at full rate: on an H100 the few-row FP8 products of the 8B shape took about 5 us more
than their bytes whatever their grid (docs/quantization.md, split K). With PDL a kernel may be
launched while the one before it still runs: the earlier kernel says so
(`gdc_launch_dependents`), the later one starts, reads
what the earlier one cannot have written (its weights), then waits for it (`gdc_wait`) before
it reads its input or writes anything. A kernel only takes part when it is launched with
`launch_pdl=True` and calls `gdc_wait` before its first dependent access; a kernel launched
without it (torch's, cuBLAS's) is ordered as usual, so mixing the two is safe. Taking part:
kernels/triton_fp8's quantizers, kernels/triton_gemv's products, triton_fused.apply_rotary,
triton_attention's K/V write, decode and split merge (their device side: triton_pdl.py).

An experiment, off by default: BUCKETSERVE_PDL=1 turns it on for devices of compute capability
9.0 and above (never under Triton's interpreter, which has no griddepcontrol). The outputs are
bit for bit those without it (the same sums in the same order): tests/test_gemv_gpu.py,
tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import os

import torch

PDL_ENV = "BUCKETSERVE_PDL"
# read at import; bench/gpu_8b.py --pdl and bench/fp8_pdl_gpu.py set it directly
ENABLED = os.environ.get(PDL_ENV, "") == "1"
_CAPABLE: dict[int, bool] = {}


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: ENABLED, a CUDA device of compute
    capability >= 9.0, and not Triton's interpreter."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(index)
    if ok is None:
        ok = _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return ok


# when a product (kernels/triton_gemv) lets the next kernel launch: "late" (after its K loop:
# at most one kernel waits on the SMs at a time), "early" (first thing, as the short kernels
# do), "off" (products launched without PDL, the short kernels with it); an experiment knob
PRODUCTS_ENV = "BUCKETSERVE_PDL_PRODUCTS"
PRODUCT_MODES = {"off": 0, "early": 1, "late": 2}
PRODUCTS = os.environ.get(PRODUCTS_ENV, "late")
if PRODUCTS not in PRODUCT_MODES:
    raise ValueError(f"{PRODUCTS_ENV}={PRODUCTS!r}: one of {', '.join(PRODUCT_MODES)}")

_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}
_PRODUCT = {"off": {"PDL": 0}, "early": {"PDL": 1, "launch_pdl": True},
            "late": {"PDL": 2, "launch_pdl": True}}


def launch_args(device: torch.device) -> dict:
    """The keyword arguments of a PDL-capable kernel's launch (spread into it, never changed):
    its PDL constexpr and, when on, Triton's `launch_pdl` option."""
    return _ON if use_pdl(device) else _OFF


def product_args(device: torch.device) -> dict:
    """`launch_args` of a product kernel (kernels/triton_gemv): its PDL constexpr is the
    PRODUCTS mode's number (0 off, 1 early, 2 late)."""
    return _PRODUCT[PRODUCTS] if use_pdl(device) else _PRODUCT["off"]
