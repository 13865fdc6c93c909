"""The quantized CPU weight path (issue 32): the Q4_1 / Q8_0 block kernels against the float32
GEMM of the dequantized weights, the int8 kernel bit for bit against its torch reference (on
this host's instruction set and, on an AVX-512 host, forced to AVX2), the served SmolLM2 in
q4_1 equal to the float32 model (greedy tokens), int8 close, and the refusals."""

from __future__ import annotations

import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_cpu_kernels import run_forced_avx2

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.kernels import cpu_quant
from bucketserve.kernels.quant import QuantizationUnsupported, resolve_quant_plan
from bucketserve.models import load_model
from bucketserve.models.gguf_loader import read_gguf_file
from bucketserve.models.loader import quantization_refusal

ROOT = Path(__file__).resolve().parent.parent
needs_kernels = pytest.mark.skipif(cpu_quant.load() is None, reason="no C compiler")
EPS32 = 2.0 ** -24


def gguf_weights(path: Path, names: tuple[str, ...]) -> dict[str, tuple[int, torch.Tensor, torch.Tensor]]:
    """name -> (qtype, blocks [N, row bytes], gguf's float32 dequantization [N, K])."""
    _, raw = read_gguf_file(path)
    out = {}
    for t in raw:
        if t.name in names:
            ref = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.qtype))
            ref = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
            out[t.name] = (t.qtype, cpu_quant.gguf_blocks(t.qtype, t.data, tuple(ref.shape)), ref)
    return out


def assert_fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      bias: torch.Tensor | None = None) -> None:
    """got within float32 summation error of x @ w^T computed exactly (float64): at most
    64 ulp-sized steps of sum |x| |w| per element (a K-term float32 sum's bound is K)."""
    exact = x.double() @ w.double().t()
    if bias is not None:
        exact += bias.double()
    bound = 64 * EPS32 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error/bound {(err / bound).max().item():.2f}"


@needs_kernels
@pytest.mark.parametrize("max_rows", [cpu_quant.Q_GEMM_MAX_ROWS, 64])
def test_blocks_dequantize_to_the_gguf_values_and_multiply_in_fp32(smollm2_path, max_rows,
                                                                    monkeypatch):
    """max_rows 64: rows above it take the dequantize + PyTorch sgemm path."""
    monkeypatch.setattr(cpu_quant, "Q_GEMM_MAX_ROWS", max_rows)
    names = ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight")
    weights = gguf_weights(smollm2_path, names)
    assert {q for q, _, _ in weights.values()} == {cpu_quant.Q4_1, cpu_quant.Q8_0}
    torch.manual_seed(0)
    for name, (qtype, blocks, ref) in weights.items():
        n, k = ref.shape
        assert torch.equal(cpu_quant.dequantize(qtype, blocks, k), ref), name  # bit for bit
        rows = (1, 7, 16) if name == "token_embd.weight" else (1, 7, 16, 65, 130)
        for m in rows:
            x = torch.randn(m, k)
            bias = torch.randn(n) if m == 7 else None
            assert_fp32_close(cpu_quant.q_linear(x, qtype, blocks, k, bias), x, ref, bias)
        wide = torch.randn(5, 2 * k)[:, ::2]  # rows with a stride, not contiguous
        assert_fp32_close(cpu_quant.q_linear(wide, qtype, blocks, k), wide, ref)


@needs_kernels
@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (5, 7, 64), (16, 130, 576), (70, 64, 1536)])
def test_int8_kernel_equals_its_reference_bit_for_bit(m, n, k):
    torch.manual_seed(m)
    w = torch.randn(n, k) * 0.02
    w[3] = 0.0  # a zero channel: scale 1
    wq, scale = cpu_quant.quantize_int8_per_channel(w)
    assert wq.dtype == torch.int8 and int(wq.abs().max()) == 127 and scale[3] == 1.0
    x = torch.randn(m, k)
    x[0, 1] = 40.0  # an outlier only moves its own row's scale
    if m > 2:
        x[2] = 0.0
    bias = torch.randn(n)
    got = cpu_quant.int8_linear(x, wq, wq.sum(dim=1, dtype=torch.int32), scale, bias)
    assert torch.equal(got, cpu_quant.int8_linear_reference(x, wq, scale, bias))
    # and close to the float32 product: per-channel weights, per-row activations
    ref = x @ w.t() + bias
    rel = (got - ref).norm(dim=1) / ref.norm(dim=1)
    assert float(rel[0]) < 0.1 and (m == 1 or float(rel[1:].max()) < 0.01)  # outlier: row 0 only


def test_int8_reference_takes_k_off_the_kernel_multiple():
    w = torch.randn(8, 40)
    wq, scale = cpu_quant.quantize_int8_per_channel(w)
    x = torch.randn(3, 40)
    got = cpu_quant.int8_linear(x, wq, wq.sum(dim=1, dtype=torch.int32), scale)
    assert torch.equal(got, cpu_quant.int8_linear_reference(x, wq, scale))


@needs_kernels
@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(), reason="host has no AVX-512")
def test_avx2_build_on_an_avx512_host(tmp_path, smollm2_path):
    """The same checks with the kernels compiled for AVX2 (x86-64-v3)."""
    script = textwrap.dedent(f"""
        import torch, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_cpu_quant import (assert_fp32_close, gguf_weights,
                                    test_int8_kernel_equals_its_reference_bit_for_bit as i8)
        from bucketserve.kernels import cpu_decode, cpu_quant
        from bucketserve.kernels.cpu_plan import resolve_cpu_plan
        cpu_decode.select(resolve_cpu_plan("avx2").march)
        assert cpu_quant.build_info()["isa"] == "avx2+fma", cpu_quant.build_info()
        assert cpu_quant.build_info()["int8_isa"] == "avx2", cpu_quant.build_info()
        from pathlib import Path
        for qtype, blocks, ref in gguf_weights(Path({str(smollm2_path)!r}),
                                               ("blk.1.ffn_gate.weight",)).values():
            for m in (1, 16, 70):
                x = torch.randn(m, ref.shape[1])
                assert_fp32_close(cpu_quant.q_linear(x, qtype, blocks, ref.shape[1]), x, ref)
        for shape in ((5, 7, 64), (16, 130, 576)):
            i8(*shape)
        print("ok")
    """)
    run_forced_avx2(script, tmp_path)


# ---- the served model --------------------------------------------------------------------

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant") / "b.toml"
    path.write_text("[kv_cache]\nprefix_caching = false\n")
    out = {}
    for q in ("none", "q4_1", "int8"):
        loaded = load_model("smollm2-135m-instruct", quantization=q)
        out[q] = LLMEngine(loaded, load_buckets(str(path), max_model_len=2048), "cpu",
                           num_blocks=64)
    return out


def test_q4_1_model_keeps_blocks_and_generates_the_fp32_tokens(engines):
    model = engines["q4_1"].runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.weight.shape == (960, 576 // 32 * 20)
    assert model.lm_head_quant is not None and model.lm_head_quant.qtype == cpu_quant.Q8_0
    assert "q4_1-blocks" in engines["q4_1"].quant.describe()
    tok = engines["none"].tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engines["none"].generate(ids, params)]
    got = [o.token_ids for o in engines["q4_1"].generate(ids, params)]
    assert got == want


def test_int8_model_stays_close_to_fp32(engines):
    model = engines["int8"].runner.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    # the LM head stays float32, on the CPU plan's packed sgemm like the float32 model's
    assert model.lm_head_quant is None and model.model.embed_tokens.weight.dtype == torch.float32
    assert model.cpu.gemm in ("onednn", "mkl") and model._lm_head_packed is not None
    assert "float32 LM head packed" in model.cpu.gemm_how
    tok = engines["none"].tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in engines["none"].generate(ids, params)]
    got = [o.token_ids for o in engines["int8"].generate(ids, params)]
    assert sum(a[0] == b[0] for a, b in zip(got, want, strict=True)) >= 2  # first tokens mostly agree


# ---- refusals ------------------------------------------------------------------------------


def test_cpu_formats_are_refused_on_cuda_with_one_line():
    for q in ("q4_1", "int8"):
        with pytest.raises(QuantizationUnsupported) as info:
            resolve_quant_plan("cuda", q)
        assert "\n" not in str(info.value) and f"--quantization {q} refused" in str(info.value)
        assert resolve_quant_plan("cpu", q).gemm == {"q4_1": "q4_1-blocks",
                                                     "int8": "int8-dynamic"}[q]


def test_q4_1_needs_a_gguf_of_q4_1_projections(tiny_llama_dir, smollm2_path):
    why = quantization_refusal(tiny_llama_dir, "q4_1")
    assert why is not None and "not a .gguf" in why and "\n" not in why
    assert quantization_refusal(tiny_llama_dir, "int8") is None
    assert quantization_refusal(smollm2_path, "q4_1") is None
    assert "float32" in quantization_refusal(smollm2_path, "int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tiny_llama_dir), quantization="q4_1")


@pytest.mark.parametrize("flags,needle", [
    (["--quantization", "q4_1", "--model", "TINY"], "not a .gguf"),
    (["--quantization", "int8", "--device", "cuda"], "CPU weight format"),
    (["--quantization", "q4_1", "--dtype", "bfloat16"], "float32"),
])
def test_serve_refuses_before_starting(flags, needle, tiny_llama_dir, capsys):
    pytest.importorskip("fastapi")
    from bucketserve.server.cli import main

    flags = [str(tiny_llama_dir) if f == "TINY" else f for f in flags]
    device = [] if "--device" in flags else ["--device", "cpu"]
    assert main(["serve", *device, "--embedding-model", "none", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bucketserve: error: ") and "\n" not in err and needle in err
