"""When the decode kernels launch with programmatic dependent launch (kernels/pdl.py): only with
BUCKETSERVE_PDL=1, only on CUDA devices of compute capability 9.0 and above, never under
Triton's interpreter. The kernels' own behaviour with it: tests/test_gemv_interp.py,
tests/test_fp8_interp.py and, compiled, tests/test_gemv_gpu.py."""

from __future__ import annotations

import importlib

import torch


def test_pdl_is_off_unless_asked_for_and_the_device_can(monkeypatch):
    from bucketserve.kernels import pdl

    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert importlib.reload(pdl).ENABLED is False
    assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": False}

    monkeypatch.setenv(pdl.PDL_ENV, "1")
    try:
        assert importlib.reload(pdl).ENABLED is True
        assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
        capability = {0: (9, 0), 1: (8, 9)}
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability[i])
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert pdl.launch_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
        assert pdl.use_pdl(torch.device("cuda", 1)) is False  # Ada: no griddepcontrol
        assert pdl.use_pdl(torch.device("cuda")) is False  # the current device, 1
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert pdl.use_pdl(torch.device("cuda", 0)) is False
    finally:  # the module as the other tests found it
        monkeypatch.delenv(pdl.PDL_ENV)
        importlib.reload(pdl)
