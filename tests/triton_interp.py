"""Triton's interpreter on the CPU, for tests of the Triton kernels without a GPU.

`interpreted_triton()` must run before anything imports bucketserve.kernels.triton_attention
(the @triton.jit decorators read TRITON_INTERPRET when they run). It skips the calling
test module when triton is not installed or when a GPU is there (the GPU tests then run
the compiled kernels, which an interpreted module in the same process would replace).
"""

from __future__ import annotations

import os

import pytest
import torch


def interpreted_triton() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the compiled kernels are tested by the GPU tests",
                    allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime import interpreter
    except ImportError:
        pytest.skip("triton is not installed", allow_module_level=True)
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
