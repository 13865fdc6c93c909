"""Compiles the PDL kernels (kernels/pdl.py) for sm_90 without a GPU and prints, per kernel,
the order of its griddepcontrol instructions and global memory accesses in the PTX, as JSON.
Run by tests/test_pdl.py in a subprocess: Triton's interpreter (which the test session turns
on without a GPU) cannot compile, so this runs with TRITON_INTERPRET unset.

    python tests/pdl_ptx.py [--no-pdl]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bucketserve.kernels import triton_attention as ta  # noqa: E402
from bucketserve.kernels import triton_fp8 as f  # noqa: E402
from bucketserve.kernels import triton_fused as tf  # noqa: E402
from bucketserve.kernels import triton_gemv as g  # noqa: E402

FLOATS = {"eps", "scale_log2", "v_scale", "k_inv", "v_inv"}
Q8 = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32", "rs_ptr": "*fp32",
      "cs_ptr": "*fp32"}
W8 = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
      "part_ptr": "*fp32", "lock_ptr": "*i32"}
POOL = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64",
        "tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_o_ptr": "*fp32",
        "part_ml_ptr": "*fp32", "nd_ptr": "*i32", "pos_ptr": "*i64", "cache_ptr": "*fp32"}
# (name, kernel, pointer types, constexprs but PDL)
KERNELS = [
    ("quantize_rows", f._quant_rows_kernel, Q8, {"STATIC": False, "BLOCK": 4096}),
    ("rms_norm_quant", f._rms_norm_quant_kernel, Q8,
     {"HAS_RESIDUAL": True, "STATIC": False, "SCALED": True, "BLOCK": 4096}),
    ("silu_and_mul_quant", f._silu_mul_quant_kernel, Q8,
     {"STATIC": False, "SCALED": False, "BLOCK": 16384}),
    ("silu_and_mul_quant chunked", f._silu_mul_quant_chunked_kernel, Q8,
     {"STATIC": False, "SCALED": True, "CHUNK": 2048}),
    ("rotary", tf._rotary_kernel, POOL, {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 64,
                                         "BLOCK_HQ": 32, "BLOCK_HKV": 8, "BLOCK_HALF": 64}),
    ("write_kv", ta._write_kv_kernel, POOL, {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "PAGE": 16,
                                             "BLOCK_H": 8, "BLOCK_D": 128, "FP8": True}),
    ("decode", ta._decode_kernel, POOL,
     {"GROUP": 4, "HEAD_DIM": 128, "PAGE": 16, "NUM_SPLITS": 4, "BLOCK_G": 16, "BLOCK_D": 128,
      "BLOCK_N": 64, "PRECISION": "tf32", "DEVICE_COUNT": False, "F16_DOT": True}),
    ("merge_splits", ta._merge_splits_kernel, POOL,
     {"HEAD_DIM": 128, "NUM_SPLITS": 4, "BLOCK_S": 4, "BLOCK_D": 128}),
    ("gemv_fp8", g._gemv_kernel, W8,
     {"BLOCK_N": 8, "BLOCK_K": 512, "EVEN_K": True, "SCALED": True, "SPLIT": 1}),
    ("gemv_fp8 split", g._gemv_kernel, W8,
     {"BLOCK_N": 8, "BLOCK_K": 512, "EVEN_K": True, "SCALED": True, "SPLIT": 4}),
    ("rows_fp8", g._rows_fp8_kernel, W8, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256,
                                          "EVEN_K": True, "FP8_DOT": True, "SPLIT": 1}),
    ("rows_fp8 split, fp16 dots", g._rows_fp8_kernel, W8,
     {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 256, "EVEN_K": False, "FP8_DOT": False,
      "SPLIT": 4}),
]


def accesses(ptx: str) -> list[str]:
    """The kernel's griddepcontrol instructions and global loads, stores and atomics in
    program order: "launch", "wait", "load:weights" (a load with the evict-first hint that
    the products give their weight loads), "load", "store", "atomic"."""
    seq = []
    for line in ptx.splitlines():
        op = line.strip().split("{")[0].split()
        if not op:
            continue
        ins = op[1] if op[0].startswith("@") and len(op) > 1 else op[0]
        if ins.startswith("griddepcontrol.launch_dependents"):
            seq.append("launch")
        elif ins.startswith("griddepcontrol.wait"):
            seq.append("wait")
        elif ins.startswith(("ld.global", "cp.async.cg.shared.global", "cp.async.ca.shared.global")):
            seq.append("load:weights" if "evict_first" in ins else "load")
        elif ins.startswith("st.global"):
            seq.append("store")
        elif ins.startswith(("atom.global", "red.global")):
            seq.append("atomic")
    return seq


def main() -> None:
    pdl = "--no-pdl" not in sys.argv
    target = GPUTarget("cuda", 90, 32)
    out = {}
    runs = []
    for name, fn, ptrs, consts in KERNELS:
        if fn in (g._gemv_kernel, g._rows_fp8_kernel):  # PDL 1 early, 2 late (pdl.PRODUCTS)
            runs += [(f"{name} early", fn, ptrs, {**consts, "PDL": int(pdl)})]
            if pdl:
                runs += [(f"{name} late", fn, ptrs, {**consts, "PDL": 2})]
        else:
            runs += [(name, fn, ptrs, {**consts, "PDL": pdl})]
    for name, fn, ptrs, consts in runs:
        sig = {}
        for p in fn.arg_names:
            if p in consts:
                sig[p] = "constexpr"
            elif p.endswith("_ptr"):
                sig[p] = ptrs.get(p, "*bf16")
            else:
                sig[p] = "fp32" if p in FLOATS else "i32"
        names = list(sig)
        # pointers 16-byte aligned and integers multiples of 16, as the launches at the 8B
        # shape specialize them
        attrs = {(names.index(n),): [["tt.divisibility", 16]]
                 for n, t in sig.items() if t.startswith("*") or t == "i32"}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        kernel = triton.compile(src, target=target, options={"num_warps": 4, "launch_pdl": pdl})
        out[name] = accesses(kernel.asm["ptx"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
