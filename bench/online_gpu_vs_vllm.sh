#!/usr/bin/env bash
# GPU, served: vLLM's OpenAI server and `bucketserve serve --device cuda`, one after the other on one
# machine, the same random-weight model, the same workload and the same load client (`bucketserve bench`),
# closed loop at each concurrency, REPS timed runs each after the same warm-up; then bucketserve's own
# offline engine on the same requests (token ids), for the online / offline ratio.
#
#   TOK=DIR WORKLOAD=FILE SHAPE=smollm2-135m|llama-1b|llama-8b CS="256 64" REPS=3 VLLM_SITE=DIR OUT=DIR \
#     bash bench/online_gpu_vs_vllm.sh
# SHAPE llama-8b: Llama-3.1-8B's shape, untied, with SmolLM2's 49,152-token vocabulary (as llama-1b).
# VLLM_ARGS / OURS_ARGS: extra flags for each server, e.g. VLLM_ARGS="--quantization fp8"
# OURS_ARGS="--quantization fp8" (LABEL_SUFFIX=_fp8 keeps such runs' files apart).
# TOK: SmolLM2's tokenizer.json / tokenizer_config.json / config.json (no weights needed).
# VLLM_SITE: vLLM 0.25.1 and its server's dependencies installed with `pip install --target`; unset or
# SKIP_VLLM=1 runs bucketserve only. DEV=cpu tries the flow on a CPU (float32). vLLM runs with prefix caching off (the timed runs repeat prompts).
# API_WORKERS=N: bucketserve's HTTP front-end processes (`serve --api-workers N`, default 1; `auto` picks by cores).
# WORKERS is the load client's process count, not the server's.
set -u
ROOT=$(pwd); CS=${CS:-256 64}; REPS=${REPS:-3}; SHAPE=${SHAPE:-smollm2-135m}; OUT=${OUT:-/tmp/online}
WARMUP=${WARMUP:-64}; WORKERS=${WORKERS:-4}; API_WORKERS=${API_WORKERS:-1}; M=/tmp/model-$SHAPE; DEV=${DEV:-cuda}
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 bench/make_random_model.py --shape "$SHAPE" --tok "$TOK" --out "$M" --device "$DEV" || exit 1
up() {  # port pid
  for _ in $(seq 1 400); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1; sleep 1; done; return 1; }
load() {  # port system
  for c in $CS; do for r in $(seq 1 "$REPS"); do
    w=$WARMUP; [ "$r" -gt 1 ] && w=0
    python3 -m bucketserve.bench bench --base-url "http://127.0.0.1:$1" --workload "$WORKLOAD" \
      --concurrency "$c" --warmup "$w" --workers "$WORKERS" --label "$2" \
      --out "$OUT/${2}_${SHAPE}_c${c}_r$r.json" > "$OUT/${2}_${SHAPE}_c${c}_r$r.log" 2>&1 || tail -3 "$OUT/${2}_${SHAPE}_c${c}_r$r.log"
  done; done; }
if [ -z "${SKIP_VLLM:-}" ] && [ -n "${VLLM_SITE:-}" ]; then
  PYTHONPATH=$VLLM_SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 python3 -m vllm.entrypoints.openai.api_server \
    --model "$M" --served-model-name m --dtype bfloat16 --max-model-len 2048 --port 8100 \
    --gpu-memory-utilization 0.85 --no-enable-prefix-caching ${VLLM_ARGS:-} > "$OUT/vllm${LABEL_SUFFIX:-}_${SHAPE}_server.log" 2>&1 &
  VP=$!; if up 8100 $VP; then load 8100 "vllm${LABEL_SUFFIX:-}"; else tail -20 "$OUT/vllm${LABEL_SUFFIX:-}_${SHAPE}_server.log"; fi
  kill $VP 2>/dev/null; wait $VP 2>/dev/null; sleep 3
fi
if [ -z "${SKIP_OURS:-}" ]; then
  # the timed runs repeat the same prompts: prefix caching off on both sides (PREFIX=1 keeps ours on)
  B="$OUT/ours.toml"; [ -n "${PREFIX:-}" ] && : > "$B" || printf '[kv_cache]\nprefix_caching = false\n' > "$B"
  python3 -m bucketserve.server.cli serve --buckets "$B" --host 127.0.0.1 --port 8200 --model "$M" \
    --embedding-model none --device "$DEV" --api-workers "$API_WORKERS" ${OURS_ARGS:-} > "$OUT/ours${LABEL_SUFFIX:-}_${SHAPE}_server.log" 2>&1 &
  BP=$!; if up 8200 $BP; then load 8200 "ours${LABEL_SUFFIX:-}"; else tail -20 "$OUT/ours${LABEL_SUFFIX:-}_${SHAPE}_server.log"; fi
  kill -TERM $BP 2>/dev/null; wait $BP 2>/dev/null
  [ -z "${SKIP_OFFLINE:-}" ] && PYTHONPATH="$ROOT:${PYTHONPATH:-}" python3 bench/offline_workload.py --model "$M" --workload "$WORKLOAD" \
    --device "$DEV" --buckets "$B" --repeats "$REPS" --out "$OUT/offline_${SHAPE}.json" > "$OUT/offline_${SHAPE}.log" 2>&1
fi
python3 bench/summarize_online.py "$OUT" "$SHAPE" | tee "$OUT/summary_${SHAPE}.txt"
