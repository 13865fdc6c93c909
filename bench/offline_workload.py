#!/usr/bin/env python3
"""bucketserve's offline engine on a JSONL workload (the requests a served benchmark sends).

    python3 bench/offline_workload.py --model DIR --workload FILE [--device cuda] [--repeats 3] [--out FILE]

The prompts are tokenized as the server tokenizes a completion prompt; every request runs with EOS
ignored, greedy, token ids only (no text), all submitted at once; a 16-request warm-up first, then
--repeats timed `LLMEngine.generate` calls. Prints and writes output tokens/s per run and the median:
the ceiling a server in front of the same engine can reach on the same requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bucketserve.engine.llm_engine import LLMEngine
from bucketserve.engine.sequence import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--buckets", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with open(a.workload) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    t0 = time.perf_counter()
    engine = LLMEngine.from_names(a.model, buckets_path=a.buckets, device=a.device)
    startup = time.perf_counter() - t0
    tok = engine.tokenizer
    prompts = [tok.encode(r["prompt"]) for r in reqs]
    params = [SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True,
                             detokenize=False) for r in reqs]
    engine.generate(prompts[:16], params[:16])  # warm-up
    runs = []
    for i in range(a.repeats):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        dt = time.perf_counter() - t
        ntok = sum(len(o.token_ids) for o in outs)
        runs.append({"seconds": dt, "output_tokens": ntok, "output_tok_s": ntok / dt})
        print(json.dumps({"run": i, **runs[-1]}), flush=True)
    result = {"system": "bucketserve-offline", "model": a.model, "workload": a.workload,
              "requests": len(reqs), "device": a.device, "startup_s": startup,
              "prompt_tokens": sum(map(len, prompts)), "runs": runs,
              "median_output_tok_s": statistics.median(r["output_tok_s"] for r in runs)}
    if a.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps({"median_output_tok_s": result["median_output_tok_s"]}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
