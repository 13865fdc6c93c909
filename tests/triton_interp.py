"""Triton's interpreter on the CPU, for tests of the Triton kernels without a GPU.

tests/conftest.py sets TRITON_INTERPRET=1 on a machine without a GPU before anything imports
triton (the @triton.jit decorators, triton's own library functions among them, read it when
they run). `interpreted_triton()` checks that, patches the interpreter for NumPy 2, and skips
the calling test when triton is not installed or when a GPU is there (the GPU tests then run
the compiled kernels).
"""

from __future__ import annotations

import os

import pytest
import torch


def interpreted_triton() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the compiled kernels are tested by the GPU tests",
                    allow_module_level=True)
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        pytest.skip("triton is not installed", allow_module_level=True)
    # conftest.py sets TRITON_INTERPRET=1 before anything imports triton; triton imported
    # earlier would have compiled-mode library functions, which the interpreter cannot call
    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(tl.cdiv,
                                                                  interpreter.InterpretedFunction):
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py "
                    "sets it on machines without a GPU)")
    # The interpreter turns a scalar tensor into an int with int(ndarray), which NumPy 2
    # refuses for the one-element arrays its scalars are: take the element instead.
    patch = interpreter._patch_lang_tensor
    if not getattr(patch, "_bucketserve_numpy2", False):
        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__",
                           lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._bucketserve_numpy2 = True
        interpreter._patch_lang_tensor = patched


def pdl_on(monkeypatch, products: str = "late") -> list[str]:
    """Kernels launched as with BUCKETSERVE_PDL=all on a Hopper GPU (their PDL constexpr on; the
    products' as BUCKETSERVE_PDL_PRODUCTS=`products` sets it), with the griddepcontrol calls,
    which the interpreter cannot run, recorded instead (in order, one entry a call)."""
    from bucketserve.kernels import pdl, triton_pdl

    calls: list[str] = []
    monkeypatch.setattr(pdl, "launch_args", lambda device, rows: {"PDL": True})
    mode = pdl.PRODUCT_MODES[products]
    monkeypatch.setattr(pdl, "product_args", lambda device, rows: {"PDL": mode})
    monkeypatch.setattr(triton_pdl, "gdc_wait", lambda: calls.append("wait"))
    monkeypatch.setattr(triton_pdl, "gdc_launch_dependents", lambda: calls.append("launch"))
    return calls
