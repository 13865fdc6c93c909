"""CPU quantized weights' accuracy (issue 32): SmolLM2-135M from its GGUF in float32 (the
reference: every tensor dequantized), --quantization q4_1 (the GGUF's own blocks) and int8
(per-channel weights, per-row int8 activations), by bench/fp8_accuracy_gpu.py's method on the
CPU:

  * perplexity over bench/data/fp8_eval_text.txt in chunks of 512 tokens, each chunk one
    prefill through the engine's model and KV pool (--chunks: the first N chunks);
  * greedy continuations (--max-tokens) of --prompts prompts cut from the same text, through
    LLMEngine.generate: per prompt, the number of leading tokens equal to float32's.

    PYTHONPATH=. python bench/cpu_quant_accuracy.py --out bench/results/cpu_quant_accuracy_amd.json

Prints one line per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from fp8_accuracy_gpu import (
    CHUNK,
    TEXT,
    leading_agreement,
    perplexity,
    prompts_from,
)

from bucketserve.buckets import load_buckets
from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams
from bucketserve.kernels import cpu_quant
from bucketserve.models import load_model

CONFIGS = ("none", "q4_1", "int8")


def make_engine(quantization: str, tmp: Path) -> LLMEngine:
    loaded = load_model("smollm2-135m-instruct", quantization=quantization)
    path = tmp / "b.toml"
    path.write_text("[kv_cache]\nblock_size = 16\nprefix_caching = false\n")
    return LLMEngine(loaded, load_buckets(str(path), max_model_len=loaded.max_model_len), "cpu",
                     num_blocks=1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    res: dict = {"env": {"torch": torch.__version__, "cpu_capability":
                         torch.backends.cpu.get_cpu_capability(), "kernels": cpu_quant.build_info(),
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "text": "bench/data/fp8_eval_text.txt", "chunk": CHUNK,
                         "max_tokens": args.max_tokens}, "configs": []}
    ref_tokens = ids = prompts = None
    for q in CONFIGS:
        engine = make_engine(q, tmp)
        if ids is None:
            ids = engine.tokenizer.encode(TEXT.read_text())[: CHUNK * args.chunks]
            prompts = prompts_from(ids, n=args.prompts)
        row = {"quantization": q, "plan": engine.quant.describe(), **perplexity(engine, ids)}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        outs = [o.token_ids for o in engine.generate(prompts, params)]
        ref_tokens = ref_tokens or outs
        agree = [leading_agreement(a, b) for a, b in zip(outs, ref_tokens, strict=True)]
        row.update(perplexity_vs_fp32=row["perplexity"] / (res["configs"][0]["perplexity"]
                                                           if res["configs"] else row["perplexity"]),
                   agree_median=statistics.median(agree), agree_min=min(agree),
                   all_agree=sum(a == args.max_tokens for a in agree), prompts=len(agree))
        res["configs"].append(row)
        print(json.dumps(row), flush=True)
        del engine
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
