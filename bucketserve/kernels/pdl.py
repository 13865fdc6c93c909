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

On by default for the steps that it was measured to speed up: steps of at most `AUTO_MAX_ROWS`
(4) rows, on devices of compute capability 9.0 and above (never under Triton's interpreter,
which has no griddepcontrol). On an H100 the 8B shape's 32-layer FP8 chain ran 1.06x faster
at 1-4 rows and 2.5-6% slower at 6-32 rows; the 8B decode step at batch 1 1.08-1.09x
(docs/quantization.md). `BUCKETSERVE_PDL` sets the rows: `auto` (unset), `off` (or 0), `all`,
or a number N (steps of at most N rows). The outputs are bit for bit those without it (the
same sums in the same order): tests/test_gemv_gpu.py, tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import os

import torch

PDL_ENV = "BUCKETSERVE_PDL"
AUTO_MAX_ROWS = 4
ALL_ROWS = 1 << 30


def max_rows(value: str | None) -> int:
    """The most rows a step may have for its kernels to launch with PDL, from BUCKETSERVE_PDL's
    value (None: unset); ValueError names the values it takes."""
    value = (value or "auto").strip().lower()
    named = {"auto": AUTO_MAX_ROWS, "off": 0, "all": ALL_ROWS}
    if value in named:
        return named[value]
    if value.isdigit():
        return int(value)
    raise ValueError(f"{PDL_ENV}={value!r}: auto, off, all or a number of rows")


# read at import; bench/gpu_8b.py --pdl ROWS and bench/fp8_pdl_gpu.py set it directly
MAX_ROWS = max_rows(os.environ.get(PDL_ENV))
_CAPABLE: dict[int, bool] = {}


def use_pdl(device: torch.device, rows: int) -> bool:
    """Whether a kernel of a step of `rows` rows (tokens) on `device` launches with PDL: at
    most MAX_ROWS rows, a CUDA device of compute capability >= 9.0, not Triton's
    interpreter."""
    if rows > MAX_ROWS or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(index)
    if ok is None:
        ok = _CAPABLE[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return ok


# when a product (kernels/triton_gemv) lets the next kernel launch: "late" (after its K loop:
# the kernels after it wait on the SMs only while it finishes; the default, measured),
# "early" (first thing, as the short kernels do: on an H100 up to 31% slower at 16-32 rows,
# where chains of launched kernels waited beside the one streaming), "off" (products
# launched without PDL, the short kernels with it); an experiment knob
PRODUCTS_ENV = "BUCKETSERVE_PDL_PRODUCTS"
PRODUCT_MODES = {"off": 0, "early": 1, "late": 2}


def product_mode(value: str | None) -> str:
    """BUCKETSERVE_PDL_PRODUCTS's value (None: unset, late) checked; ValueError names the
    values it takes."""
    mode = (value or "late").strip().lower()
    if mode not in PRODUCT_MODES:
        raise ValueError(f"{PRODUCTS_ENV}={value!r}: one of {', '.join(PRODUCT_MODES)}")
    return mode


PRODUCTS = product_mode(os.environ.get(PRODUCTS_ENV))


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Raises ValueError (one line, the variable and the values it takes) for a value of
    BUCKETSERVE_PDL or BUCKETSERVE_PDL_PRODUCTS that this module would refuse at import:
    `bucketserve serve` asks before it starts a process (on the CPU too, where the module is
    never imported)."""
    env = os.environ if environ is None else environ
    max_rows(env.get(PDL_ENV))
    product_mode(env.get(PRODUCTS_ENV))


_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}
_PRODUCT = {"off": {"PDL": 0}, "early": {"PDL": 1, "launch_pdl": True},
            "late": {"PDL": 2, "launch_pdl": True}}


def launch_args(device: torch.device, rows: int) -> dict:
    """The keyword arguments of a PDL-capable kernel's launch (spread into it, never changed):
    its PDL constexpr and, when on (`use_pdl`), Triton's `launch_pdl` option."""
    return _ON if use_pdl(device, rows) else _OFF


def product_args(device: torch.device, rows: int) -> dict:
    """`launch_args` of a product kernel (kernels/triton_gemv): its PDL constexpr is the
    PRODUCTS mode's number (0 off, 1 early, 2 late)."""
    return _PRODUCT[PRODUCTS] if use_pdl(device, rows) else _PRODUCT["off"]
