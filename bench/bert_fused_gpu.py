#!/usr/bin/env python3
"""Do the BERT encoder's fused kernels pay on this GPU? (issue 10: "fused kernels where
measurement says they pay"). One process, all-MiniLM-L6-v2 in float16 (or --dtype):

- variants: `plain` (torch ops: GEMM with its bias, GELU, add, LayerNorm), `addnorm` (residual
  add + LayerNorm as one Triton kernel, kernels/triton_bert.py), `addnorm+epilogue` (also the
  feed-forward bias + GELU in cuBLASLt's GEMM epilogue: the tanh GELU, an approximation for
  this model's erf GELU);
- per (batch, length) shape: the device time of one forward as the served path runs it, a
  CUDA graph of `embed_lengths` replayed (median of --repeats timings of --replays replays,
  the variants interleaved so that clock drift falls on all alike);
- per-kernel device time by kind (torch.profiler over eager forwards: GEMM, attention,
  LayerNorm, GELU, elementwise add, other) at --profile-shape;
- accuracy: the smallest cosine, over every row of every shape, against sentence-transformers
  in float32 on the same weights.

    python bench/bert_fused_gpu.py [--model-dir DIR] [--dtype float16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))

import torch  # noqa: E402

VARIANTS = {"plain": (False, False), "addnorm": (True, False), "addnorm+epilogue": (True, True)}
SHAPES = [(1, 16), (8, 64), (32, 128), (64, 64), (64, 128), (64, 256), (128, 128), (256, 64)]


def kind_of(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n or "cublas" in n:
        return "gemm"
    if "fmha" in n or "flash" in n or "attention" in n or "efficient" in n:
        return "attention"
    if "_add_layer_norm" in n:
        return "add+layernorm (fused)"
    if "layer_norm" in n or "layernorm" in n:
        return "layernorm"
    if "gelu" in n:
        return "gelu"
    if "add" in n and "elementwise" in n or "cuda::add" in n:
        return "add"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None, help="default: the packaged all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-shape", default="64x128")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    from bucketserve.models.bert_loader import load_embedding_model

    dtype = getattr(torch, a.dtype)
    loaded = load_embedding_model(a.model_dir or "all-minilm-l6-v2", device="cuda", dtype=dtype)
    model = loaded.model
    st = SentenceTransformer(str(loaded.path), device="cuda").float()
    g = torch.Generator().manual_seed(0)
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "dtype": a.dtype, "shapes": {}, "profile": {}, "min_cosine": {}}

    def inputs(B: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(1000, 29000, (B, L), generator=g, dtype=torch.int32)
        ids[:, 0] = 101
        lengths = torch.randint(max(1, L // 2), L + 1, (B,), generator=g, dtype=torch.int32)
        return ids.cuda(), lengths.cuda()

    def reference(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        L = ids.shape[1]
        mask = (torch.arange(L, device="cuda")[None, :] < lengths[:, None]).long()
        with torch.no_grad():
            o = st({"input_ids": ids.long(), "attention_mask": mask,
                    "token_type_ids": torch.zeros_like(mask)})
        return torch.nn.functional.normalize(o["sentence_embedding"].float(), dim=-1)

    min_cos = {v: 1.0 for v in VARIANTS}
    with torch.inference_mode():
        for B, L in SHAPES:
            ids, lengths = inputs(B, L)
            ref = reference(ids, lengths)
            graphs = {}
            for name, (add_norm, epi) in VARIANTS.items():
                model.use_fused_kernels(add_norm=add_norm, gelu_epilogue=epi)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        model.embed_lengths(ids, lengths)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    res = model.embed_lengths(ids, lengths)
                graph.replay()
                torch.cuda.synchronize()
                cos = torch.nn.functional.cosine_similarity(res.float(), ref, dim=-1).min().item()
                min_cos[name] = min(min_cos[name], cos)
                graphs[name] = graph
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(a.repeats):
                for name, graph in graphs.items():
                    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    for _ in range(5):
                        graph.replay()
                    start.record()
                    for _ in range(a.replays):
                        graph.replay()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) * 1000 / a.replays)
            med = {v: statistics.median(t) for v, t in times.items()}
            out["shapes"][f"{B}x{L}"] = {
                "us": med, "speedup_vs_plain": {v: med["plain"] / t for v, t in med.items()}}
            print(f"{B:4d} x {L:4d}: " + "  ".join(f"{v} {t:8.1f} us" for v, t in med.items()),
                  flush=True)
            del graphs
        out["min_cosine"] = min_cos
        print("min cosine vs sentence-transformers fp32:", min_cos, flush=True)

        B, L = (int(x) for x in a.profile_shape.split("x"))
        ids, lengths = inputs(B, L)
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        for name, (add_norm, epi) in VARIANTS.items():
            model.use_fused_kernels(add_norm=add_norm, gelu_epilogue=epi)
            for _ in range(3):
                model.embed_lengths(ids, lengths)
            torch.cuda.synchronize()
            n = 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    model.embed_lengths(ids, lengths)
                torch.cuda.synchronize()
            kinds: dict[str, float] = {}
            for ev in prof.key_averages():
                if ev.device_type != DeviceType.CUDA:  # kernels only (ops would count twice)
                    continue
                us = getattr(ev, "self_device_time_total", None)
                if us is None:
                    us = ev.self_cuda_time_total
                if us:
                    k = kind_of(ev.key)
                    kinds[k] = kinds.get(k, 0.0) + us / n
            total = sum(kinds.values())
            out["profile"][name] = {"shape": a.profile_shape, "device_us": total,
                                    "by_kind_us": dict(sorted(kinds.items(),
                                                              key=lambda kv: -kv[1]))}
            print(f"profile {name} {a.profile_shape}: {total:.1f} us/forward "
                  + ", ".join(f"{k} {v:.1f}" for k, v in out["profile"][name]["by_kind_us"].items()),
                  flush=True)
    model.use_fused_kernels(add_norm=False, gelu_epilogue=False)
    out["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
