"""FP8 accuracy on a GPU (issue 28, must-show 1): the default SmolLM2-135M (its GGUF weights
dequantized to bf16 are the reference) with FP8 weights, an FP8 KV pool, and both, against
bf16:

  * perplexity over bench/data/fp8_eval_text.txt (module and API docstrings of Python 3.11's
    standard library, 120 kB, fixed in the repo), in chunks of 512 tokens, each chunk one
    prefill through the engine's model and KV pool (so an FP8 pool's rounding counts);
  * greedy continuations (64 tokens) of 64 prompts cut from the same text (16..160 tokens),
    through LLMEngine.generate: per prompt, the number of leading tokens equal to bf16's.

    PYTHONPATH=. python3 bench/fp8_accuracy_gpu.py --out $OUT [--model PATH.gguf]

Writes OUT/fp8_accuracy.json and prints one line per configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.kernels.attention import AttentionMetadata, forward_context
from bucketserve.models import load_model

ROOT = Path(__file__).resolve().parent.parent

TEXT = ROOT / "bench" / "data" / "fp8_eval_text.txt"
CONFIGS = [("bf16", "none", "auto"), ("fp8 weights", "fp8", "auto"),
           ("fp8 KV", "none", "fp8"), ("fp8 weights + KV", "fp8", "fp8")]
# --fp8-fast-accum: the FP8-weight configurations again with kernels/fp8_ops.FAST_ACCUM
FAST_CONFIGS = [("fp8 weights, fast accumulation", "fp8", "auto"),
                ("fp8 weights + KV, fast accumulation", "fp8", "fp8")]
CHUNK = 512
BLOCK = 16


def make_engine(model: str, quantization: str, kv: str, tmp: str,
                device: str = "cuda") -> LLMEngine:
    loaded = load_model(model, device=device, dtype=torch.bfloat16,
                        quantization=quantization)
    path = Path(tmp) / f"{quantization}_{kv}.toml"
    path.write_text(f'[model]\nquantization = "{quantization}"\n[kv_cache]\ndtype = "{kv}"\n'
                    f"block_size = {BLOCK}\nprefix_caching = false\n")
    buckets = load_buckets(str(path), max_model_len=loaded.max_model_len)
    return LLMEngine(loaded, buckets, device, num_blocks=4096)


@torch.inference_mode()
def perplexity(engine: LLMEngine, ids: list[int]) -> dict:
    """Each chunk of CHUNK tokens as one prefill over blocks 1.. of the engine's pool."""
    model = engine.runner.model
    dev = engine.device
    nll, count = 0.0, 0
    nblk = CHUNK // BLOCK
    table = torch.arange(1, 1 + nblk, dtype=torch.int32, device=dev)[None]
    pos = torch.arange(CHUNK, device=dev)
    slots = (table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, CHUNK], dtype=torch.int32,
                                                         device=dev),
        seq_lens=torch.tensor([CHUNK], dtype=torch.int32, device=dev), block_tables=table,
        num_decodes=0, max_query_len=CHUNK, max_seq_len=CHUNK, query_lens_cpu=[CHUNK],
        seq_lens_cpu=[CHUNK])
    for start in range(0, len(ids) - CHUNK + 1, CHUNK):
        x = torch.tensor(ids[start:start + CHUNK], device=dev)
        with forward_context(meta):
            hidden = model(x, pos)
        logp = torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)
        nll -= logp.gather(1, x[1:, None]).sum().item()
        count += CHUNK - 1
    return {"perplexity": math.exp(nll / count), "tokens": count, "chunks": count // (CHUNK - 1)}


def prompts_from(ids: list[int], n: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(len(ids) - 200), n))
    return [ids[s:s + rng.randint(16, 160)] for s in starts]


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a registered name or the path of the SmolLM2 GGUF")
    ap.add_argument("--configs", type=int, default=len(CONFIGS),
                    help="the first N configurations (1: bf16 only, e.g. a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp8-fast-accum", action="store_true",
                    help="also the FP8-weight configurations with torch._scaled_mm's "
                         "use_fast_accum (kernels/fp8_ops.FAST_ACCUM)")
    args = ap.parse_args()
    from bucketserve.kernels import fp8_ops
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none"
    res: dict = {"env": {"torch": torch.__version__, "gpu": gpu,
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "text": str(TEXT.relative_to(ROOT)), "chunk": CHUNK,
                         "max_tokens": args.max_tokens}, "configs": []}
    tmp = tempfile.mkdtemp()
    ref_tokens = None
    ids = prompts = None
    configs = CONFIGS[:args.configs] + (FAST_CONFIGS if args.fp8_fast_accum else [])
    for label, quantization, kv in configs:
        fp8_ops.FAST_ACCUM = "fast accumulation" in label
        engine = make_engine(args.model, quantization, kv, tmp, args.device)
        if ids is None:
            ids = engine.tokenizer.encode(TEXT.read_text())
            prompts = prompts_from(ids)
        row = {"config": label, "quantization": quantization, "kv_cache_dtype": kv,
               "plan": engine.quant.describe(), "fp8_fast_accum": fp8_ops.FAST_ACCUM,
               **perplexity(engine, ids)}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        outs = [o.token_ids for o in engine.generate(prompts, params)]
        if ref_tokens is None:
            ref_tokens = outs
        agree = [leading_agreement(a, b) for a, b in zip(outs, ref_tokens, strict=True)]
        row.update(leading_agreement=agree, agree_median=statistics.median(agree),
                   agree_mean=statistics.mean(agree), agree_min=min(agree),
                   all_agree=sum(a == args.max_tokens for a in agree),
                   first_token_agrees=sum(a >= 1 for a in agree),
                   histogram={f"{lo}-{lo + 7}": sum(lo <= a <= lo + 7 for a in agree)
                              for lo in range(0, args.max_tokens, 8)})
        res["configs"].append(row)
        base = res["configs"][0]["perplexity"]
        row["perplexity_vs_bf16"] = row["perplexity"] / base
        print(json.dumps({k: v for k, v in row.items() if k != "leading_agreement"}), flush=True)
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_accuracy.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
