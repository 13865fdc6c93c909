"""The GPU KV budget's arithmetic (engine/kv_budget.py kv_budget_blocks) on injected memory
readings: gpu_memory_fraction is this process's share of the device; other processes' memory
is not counted against it but is never taken; too little room is a start-up error."""

from __future__ import annotations

import sys
import types

import pytest

from bucketserve.engine import kv_budget
from bucketserve.engine.kv_budget import GIB, GpuMemory, kv_budget_blocks

TOTAL = 140 * GIB
BLOCK = 2**20  # 1 MiB a block
RESERVE = GIB // 4


def test_the_second_of_two_replicas_on_one_gpu_gets_its_own_share() -> None:
    """Two replicas at fraction 0.45: the first holds its 63 GiB; the second (1 GiB context,
    2.5 GiB weights + activations) still gets 0.45 of the device less its own use, where
    the old arithmetic counted the first's 63 GiB as its own and left it 2 blocks."""
    own, peak = GIB, 5 * GIB // 2
    first = int(0.45 * TOTAL)
    mem = GpuMemory(total=TOTAL, free=TOTAL - first - own - 3 * GIB, reserved=3 * GIB,
                    own_outside=own, peak=peak)
    blocks, info = kv_budget_blocks(mem, 0.45, BLOCK, min_blocks=10, reserve_bytes=RESERVE)
    assert blocks == int((0.45 * TOTAL - own - peak - RESERVE) // BLOCK)
    assert info["bound"] == "fraction"
    old = 0.45 * TOTAL - (mem.total - mem.free - mem.reserved) - peak - RESERVE
    assert old < 0  # what the old formula (every process's memory counted) gave


def test_alone_on_the_gpu_it_is_the_old_arithmetic() -> None:
    """With no other process, own_outside is everything outside torch: same as before."""
    own, reserved, peak = GIB, 20 * GIB, 18 * GIB
    mem = GpuMemory(total=TOTAL, free=TOTAL - own - reserved, reserved=reserved,
                    own_outside=own, peak=peak)
    blocks, _ = kv_budget_blocks(mem, 0.9, BLOCK, min_blocks=10, reserve_bytes=RESERVE,
                                 graph_act=GIB)
    outside = mem.total - mem.free - mem.reserved
    assert blocks == int((0.9 * TOTAL - outside - peak - RESERVE - GIB) // BLOCK)


def test_the_pool_never_takes_more_than_is_free() -> None:
    """Another process holds 100 GiB: the 0.45 share does not fit; the free memory less
    what start-up keeps back bounds the pool."""
    own, reserved = GIB, 4 * GIB
    free = TOTAL - 100 * GIB - own - reserved
    mem = GpuMemory(total=TOTAL, free=free, reserved=reserved, own_outside=own, peak=3 * GIB)
    blocks, info = kv_budget_blocks(mem, 0.45, BLOCK, min_blocks=10, reserve_bytes=RESERVE,
                                    graph_act=GIB)
    assert blocks == (free - RESERVE - GIB) // BLOCK
    assert info["bound"] == "free memory"


def test_a_share_too_small_for_one_sequence_is_a_start_up_error() -> None:
    mem = GpuMemory(total=TOTAL, free=TOTAL // 2, reserved=20 * GIB, own_outside=GIB,
                    peak=20 * GIB)
    with pytest.raises(ValueError, match=r"at least 100 blocks.*gpu_memory_fraction 0.15"):
        kv_budget_blocks(mem, 0.15, GIB // 4, min_blocks=100, reserve_bytes=RESERVE)


def test_too_little_free_memory_is_a_start_up_error_naming_the_others() -> None:
    """The case of the shared-GPU run: other processes hold nearly the whole device."""
    own, reserved = GIB, 4 * GIB
    mem = GpuMemory(total=TOTAL, free=GIB // 2, reserved=reserved, own_outside=own,
                    peak=3 * GIB)
    with pytest.raises(ValueError, match=r"0\.50 GiB of the GPU is free \(other processes "
                                         r"on it hold 134\.50 GiB\)"):
        kv_budget_blocks(mem, 0.45, BLOCK, min_blocks=1000, reserve_bytes=RESERVE)


def test_own_memory_outside_torch_reads_nvml_for_this_pid(monkeypatch) -> None:
    """NVML's use of this pid less torch's reserved memory; without a row for this pid
    (another PID namespace) or without pynvml, the documented estimate."""
    import os

    rows: list = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: rows)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(kv_budget.torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid="abc"))
    monkeypatch.setattr(kv_budget.torch.cuda, "memory_reserved", lambda d: 6 * GIB)
    assert kv_budget.own_memory_outside_torch("cuda") == (kv_budget.CONTEXT_ESTIMATE_BYTES,
                                                          "estimate")
    rows.extend([types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=60 * GIB),
                 types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=6 * GIB + 700 * 2**20)])
    assert kv_budget.own_memory_outside_torch("cuda") == (700 * 2**20, "NVML")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable
    assert kv_budget.own_memory_outside_torch("cuda")[1] == "estimate"


def test_front_end_encoders_come_off_the_share_not_twice_off_the_free_memory() -> None:
    """The case of the 80 GB card with 8 API workers each holding an encoder (0.8 GiB): the
    pool once took 0.9 of the device and the workers' encoders ran out of memory. Their
    bytes now come off the server's share; the free reading already lacks them."""
    total, own, peak, workers = 80 * GIB, GIB, 17 * GIB, 8 * (4 * GIB // 5)
    mem = GpuMemory(total=total, free=total - own - peak - workers, reserved=peak,
                    own_outside=own, peak=peak)
    blocks, info = kv_budget_blocks(mem, 0.9, BLOCK, min_blocks=10, reserve_bytes=RESERVE,
                                    frontend_bytes=workers)
    assert blocks == int((0.9 * total - own - peak - workers - RESERVE) // BLOCK)
    assert info["bound"] == "fraction" and info["frontend_gib"] == workers / GIB
    before, _ = kv_budget_blocks(mem, 0.9, BLOCK, min_blocks=10, reserve_bytes=RESERVE)
    assert (before - blocks) * BLOCK == pytest.approx(workers, abs=BLOCK)
    # what is left on the device after the pool: the share's tenth, not less
    assert total - own - peak - workers - blocks * BLOCK >= 0.1 * total


def test_the_core_waits_for_every_front_end_report_and_sums_them(tmp_path) -> None:
    import threading
    import time

    from bucketserve.engine.kv_budget import wait_frontend_reports, write_frontend_report

    write_frontend_report(str(tmp_path), 0, 3 * GIB)

    def late() -> None:
        time.sleep(0.3)
        write_frontend_report(str(tmp_path), 1, GIB // 2)

    t = threading.Thread(target=late)
    t.start()
    t0 = time.monotonic()
    assert wait_frontend_reports(str(tmp_path), 2, timeout_s=10.0) == 3 * GIB + GIB // 2
    assert time.monotonic() - t0 >= 0.25  # it waited for the second
    t.join()
    with pytest.raises(TimeoutError, match=r"front ends \[2\] did not report"):
        wait_frontend_reports(str(tmp_path), 3, timeout_s=0.2)


def test_only_a_gpu_encoder_makes_the_front_end_load_first() -> None:
    from bucketserve.server.startup import frontend_uses_gpu

    def args(device: str, emb: str = "none", rerank: str | None = None):
        return types.SimpleNamespace(device=device, embedding_model=emb, rerank_model=rerank)

    assert frontend_uses_gpu(args("cuda", "all-minilm-l6-v2"))
    assert frontend_uses_gpu(args("cuda", rerank="some-cross-encoder"))
    assert not frontend_uses_gpu(args("cuda"))
    assert not frontend_uses_gpu(args("cuda", "None"))
    assert not frontend_uses_gpu(args("cpu", "all-minilm-l6-v2"))
