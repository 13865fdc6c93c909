#!/usr/bin/env bash
# Issue 30 must-show 3, both servers in one command: bench/structured_gpu.py (256 streams of the
# mixed workload, half of them with a distinct JSON schema each; REPEATS timed plain / schema
# pairs after one untimed pair of each, medians) against vLLM's OpenAI server first, then
# `bucketserve serve --device cuda`, on the same random-weight model, prefix caching off on both.
#
#   TOK=DIR VLLM_SITE=DIR OUT=DIR [SHAPE=llama-1b] [REPEATS=3] bash bench/structured_gpu_vs_vllm.sh
#
# TOK: SmolLM2's config.json / tokenizer files (bench/make_random_model.py). VLLM_SITE: vLLM 0.25.1
# and its server's dependencies (pip install --target); SKIP_VLLM=1 runs bucketserve alone.
# Output: OUT/structured_{vllm,bucketserve}_SHAPE.json, server logs, OUT/structured_summary.txt.
set -u
SHAPE=${SHAPE:-llama-1b}; OUT=${OUT:-/tmp/structured}; REPEATS=${REPEATS:-3}; M=/tmp/model-$SHAPE
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
python3 bench/make_random_model.py --shape "$SHAPE" --tok "$TOK" --out "$M" --device cuda || exit 1
if [ -z "${SKIP_VLLM:-}" ]; then
  PYTHONPATH="$PYTHONPATH:$VLLM_SITE" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
    python3 bench/structured_gpu.py --repeats "$REPEATS" --out "$OUT/structured_vllm_$SHAPE.json" \
    --base-url http://127.0.0.1:8100 --server-cmd "python3 -m vllm.entrypoints.openai.api_server \
    --model $M --served-model-name m --dtype bfloat16 --max-model-len 2048 --port 8100 \
    --gpu-memory-utilization 0.85 --no-enable-prefix-caching" 2>&1 | tail -40 > "$OUT/vllm_$SHAPE.log"
  tail -4 "$OUT/vllm_$SHAPE.log"; sleep 3
fi
printf '[kv_cache]\nprefix_caching = false\n' > "$OUT/ours.toml"  # the repeats reuse prompts
python3 bench/structured_gpu.py --repeats "$REPEATS" --out "$OUT/structured_bucketserve_$SHAPE.json" \
  --base-url http://127.0.0.1:8200 --server-cmd "python3 -m bucketserve.server.cli serve --model $M \
  --embedding-model none --device cuda --port 8200 --buckets $OUT/ours.toml" \
  > "$OUT/bucketserve_$SHAPE.log" 2>&1
tail -4 "$OUT/bucketserve_$SHAPE.log"
python3 - "$OUT" "$SHAPE" <<'PY' | tee "$OUT/structured_summary.txt"
import json, os, sys
out, shape = sys.argv[1:]
rows = {}
for system in ("vllm", "bucketserve"):
    p = os.path.join(out, f"structured_{system}_{shape}.json")
    if os.path.exists(p):
        rows[system] = r = json.load(open(p))
        print(f"{system}: plain {r['plain_tok_s']:.0f} tok/s, with schemas {r['schema_tok_s']:.0f} "
              f"({r['tok_s_ratio']:.2f}x); free-half ITL p99 {r['plain_free_itl_p99_ms']} -> "
              f"{r['schema_free_itl_p99_ms']} ms ({r['free_itl_p99_ratio']}x); errors {r['errors']}")
if len(rows) == 2:
    v, b = rows["vllm"], rows["bucketserve"]
    print(f"bucketserve / vLLM: plain {b['plain_tok_s'] / v['plain_tok_s']:.2f}x, "
          f"with schemas {b['schema_tok_s'] / v['schema_tok_s']:.2f}x")
PY
