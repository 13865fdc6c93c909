"""When the decode kernels launch with programmatic dependent launch (kernels/pdl.py): steps of at
most BUCKETSERVE_PDL's rows (4 unless set), only on CUDA devices of compute capability 9.0 and
above, never under Triton's interpreter. The kernels' own behaviour with it:
tests/test_gemv_interp.py, tests/test_fp8_interp.py and, compiled, tests/test_gemv_gpu.py."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.mark.parametrize("value, rows", [(None, 4), ("auto", 4), ("off", 0), ("0", 0),
                                         ("ALL", 1 << 30), ("16", 16), (" 2 ", 2)])
def test_pdl_rows_from_the_environment(monkeypatch, value, rows):
    from bucketserve.kernels import pdl

    if value is None:
        monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(pdl.PDL_ENV, value)
    try:
        assert importlib.reload(pdl).MAX_ROWS == rows
    finally:  # the module as the other tests found it
        monkeypatch.delenv(pdl.PDL_ENV, raising=False)
        importlib.reload(pdl)


@pytest.mark.parametrize("value", ["on", "yes", "-1", "1.5"])
def test_a_bad_pdl_value_is_refused_with_the_values_it_takes(value):
    from bucketserve.kernels import pdl

    with pytest.raises(ValueError, match="auto, off, all or a number of rows"):
        pdl.max_rows(value)
    with pytest.raises(ValueError, match="BUCKETSERVE_PDL=.*auto, off, all"):
        pdl.check_environment({pdl.PDL_ENV: value})
    with pytest.raises(ValueError, match="BUCKETSERVE_PDL_PRODUCTS=.*off, early, late"):
        pdl.check_environment({pdl.PRODUCTS_ENV: value})
    pdl.check_environment({pdl.PDL_ENV: "8", pdl.PRODUCTS_ENV: "Early"})
    pdl.check_environment({})


def test_pdl_only_for_few_rows_on_a_device_that_can(monkeypatch):
    from bucketserve.kernels import pdl

    capability = {0: (9, 0), 1: (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(pdl, "_CAPABLE", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "MAX_ROWS", 4)
    hopper = torch.device("cuda", 0)
    assert pdl.launch_args(hopper, 1) == pdl.launch_args(hopper, 4) == {"PDL": True,
                                                                        "launch_pdl": True}
    assert pdl.launch_args(hopper, 5) == {"PDL": False}
    assert pdl.product_args(hopper, 4) == {"PDL": pdl.PRODUCT_MODES[pdl.PRODUCTS],
                                           "launch_pdl": True}
    assert pdl.product_args(hopper, 64) == {"PDL": 0}
    assert pdl.launch_args(torch.device("cpu"), 1) == {"PDL": False}
    assert pdl.use_pdl(torch.device("cuda", 1), 1) is False  # Ada: no griddepcontrol
    assert pdl.use_pdl(torch.device("cuda"), 1) is False  # the current device, 1
    monkeypatch.setattr(pdl, "MAX_ROWS", 0)
    assert pdl.launch_args(hopper, 1) == {"PDL": False}
    monkeypatch.setattr(pdl, "MAX_ROWS", pdl.ALL_ROWS)
    assert pdl.use_pdl(hopper, 512) is True
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.use_pdl(hopper, 1) is False


def test_compiled_kernels_wait_before_their_first_dependent_access():
    """The PDL kernels compiled for sm_90 (no GPU needed; tests/pdl_ptx.py reads the PTX):
    each program lets the next kernel launch once (first thing; a product in the late mode
    after its K loop: after its last weight load, before its stores), waits once for the kernel
    before it, and before that wait touches nothing but its weights (the products' first slice,
    loaded with the evict-first hint): no input read, no store, no atomic. Compiled without PDL, no
    kernel has a griddepcontrol instruction. The interpreter tests cannot see this order: the
    compiler could move a load above the wait."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)

    def compiled(*flags: str) -> dict[str, list[str]]:
        run = subprocess.run([sys.executable, str(root / "tests" / "pdl_ptx.py"), *flags],
                             capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout)

    with_pdl = compiled()
    assert len(with_pdl) == 16
    for name, seq in with_pdl.items():
        assert seq.count("launch") == 1 and seq.count("wait") == 1, name
        late = name.endswith(" late")
        if late:
            assert seq.index("launch") > seq.index("wait"), name
        else:
            assert seq[0] == "launch", name
        before = [a for a in seq[:seq.index("wait")] if a != "launch"]
        after = seq[seq.index("wait") + 1:]
        if name.startswith(("gemv", "rows")):
            assert before and set(before) == {"load:weights"}, (name, before)
            assert "load" in after, name  # x (and the loop's further slices)
        else:
            assert before == [], (name, before)
        if late:  # after the K loop: every weight load before it, the output stores after
            assert "load:weights" not in seq[seq.index("launch"):], name
            assert "store" in seq[seq.index("launch"):], name
        assert "store" in after, name
    for name, seq in compiled("--no-pdl").items():
        assert "launch" not in seq and "wait" not in seq, name


@pytest.mark.parametrize("name", ["BUCKETSERVE_PDL", "BUCKETSERVE_PDL_PRODUCTS"])
def test_serve_refuses_a_bad_pdl_value_before_starting(name, monkeypatch, capsys):
    """On the CPU too, where kernels/pdl is never imported: one line, exit status 2."""
    pytest.importorskip("fastapi")  # the server's own dependency (absent on the GPU image)
    from bucketserve.server.cli import main

    monkeypatch.setenv(name, "sometimes")
    assert main(["serve", "--device", "cpu", "--embedding-model", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bucketserve: error: {name}='sometimes'") and "\n" not in err
