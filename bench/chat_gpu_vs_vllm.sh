#!/usr/bin/env bash
# Issue 12, must-show 3: the seeded multi-turn chat workload of bench/chat_workload.py against vLLM's
# OpenAI server (prefix caching on) and `bucketserve serve` (prefix caching on, the default), one after
# the other on one machine, the same random-weight model (SmolLM2-135M shape, SmolLM2's tokenizer),
# the same client. Per server: one warm-up run, then REPS timed runs, each with its own seed, so each
# run has its own system prompt and conversations: no run hits the cache another run filled (the
# servers are not restarted between runs). Reported: medians over the runs of TTFT p50 and output tok/s.
#
#   TOK=DIR VLLM_SITE=DIR OUT=DIR bash bench/chat_gpu_vs_vllm.sh
# TOK: SmolLM2's tokenizer.json / tokenizer_config.json / config.json (+ chat template); no weights.
# VLLM_SITE: vLLM 0.25.1 and its server's dependencies (pip install --target); SITE (default VLLM_SITE):
#   fastapi / uvicorn / sse-starlette for bucketserve's server. SKIP_VLLM=1 runs bucketserve only;
#   DEV=cpu tries the flow on a CPU (float32, bucketserve only).
# Workload (defaults = issue 12's example): CONVS=64 TURNS=4 CONC=64 SYSTEM_WORDS=930 (~1,000 tokens)
#   MAX_TOKENS=64 REPS=3. Everything goes to WORK (/tmp/chat_work); OUT gets chat_summary.json / .txt
#   and chat_all.tgz.
set -u
ROOT=$(pwd); DEST=${OUT:-/tmp/chat}; W=${WORK:-/tmp/chat_work}; DEV=${DEV:-cuda}; REPS=${REPS:-3}
CONVS=${CONVS:-64}; TURNS=${TURNS:-4}; CONC=${CONC:-64}; SYSTEM_WORDS=${SYSTEM_WORDS:-930}
MAX_TOKENS=${MAX_TOKENS:-64}; M=/tmp/model-smollm2-135m-chat; SITE=${SITE:-${VLLM_SITE:-}}
mkdir -p "$W" "$DEST"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$ROOT${SITE:+:$SITE}"
DTYPE=bfloat16; [ "$DEV" = cpu ] && DTYPE=float32
python3 - "$TOK" "$M" "$DEV" <<'PY'
import os, shutil, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
tok, d, dev = sys.argv[1:]
os.makedirs(d, exist_ok=True)
for f in os.listdir(tok):
    shutil.copy(os.path.join(tok, f), d)
cfg = LlamaConfig.from_pretrained(d)
cfg.tie_word_embeddings = True
torch.manual_seed(0)
with torch.device(dev):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32)
m.save_pretrained(d)
print("SmolLM2-135M shape, random weights:", sum(p.numel() for p in m.parameters()), "parameters")
PY
up() {  # port pid
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1; sleep 1; done; return 1; }
name() { curl -sf "http://127.0.0.1:$1/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])'; }
runs() {  # port system metrics
  local model; model=$(name "$1")
  # warm-up: its own seed (its own system prompt), a quarter of the conversations, 2 turns
  python3 bench/chat_workload.py --base-url "http://127.0.0.1:$1" --model "$model" --label "$2 warm-up" \
    --metrics "$3" --conversations $(( (CONVS + 3) / 4 )) --turns 2 --concurrency "$CONC" \
    --system-words "$SYSTEM_WORDS" --max-tokens "$MAX_TOKENS" --seed 1000 \
    --out "$W/chat_${2}_warmup.json" > "$W/chat_${2}_warmup.log" 2>&1 || tail -5 "$W/chat_${2}_warmup.log"
  for r in $(seq 1 "$REPS"); do
    python3 bench/chat_workload.py --base-url "http://127.0.0.1:$1" --model "$model" --label "$2 run $r" \
      --metrics "$3" --conversations "$CONVS" --turns "$TURNS" --concurrency "$CONC" \
      --system-words "$SYSTEM_WORDS" --max-tokens "$MAX_TOKENS" --seed "$r" \
      --out "$W/chat_${2}_r$r.json" > "$W/chat_${2}_r$r.log" 2>&1 || tail -5 "$W/chat_${2}_r$r.log"
    grep -h '"label"' "$W/chat_${2}_r$r.log" | cut -c1-300
  done; }
if [ -z "${SKIP_VLLM:-}" ] && [ -n "${VLLM_SITE:-}" ] && [ "$DEV" = cuda ]; then
  echo "== vLLM server, prefix caching on"
  PYTHONPATH=$VLLM_SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 python3 -m vllm.entrypoints.openai.api_server \
    --model "$M" --served-model-name m --dtype bfloat16 --max-model-len 4096 --port 8100 \
    --gpu-memory-utilization 0.85 --enable-prefix-caching > "$W/chat_vllm_server.log" 2>&1 &
  VP=$!; if up 8100 $VP; then runs 8100 vllm vllm; else tail -20 "$W/chat_vllm_server.log"; fi
  kill $VP 2>/dev/null; wait $VP 2>/dev/null; sleep 3
fi
echo "== bucketserve serve --device $DEV, prefix caching on"
python3 -m bucketserve.server.cli serve --host 127.0.0.1 --port 8200 --model "$M" --embedding-model none \
  --device "$DEV" --dtype "$DTYPE" > "$W/chat_ours_server.log" 2>&1 &
BP=$!; if up 8200 $BP; then runs 8200 ours bucketserve; else tail -20 "$W/chat_ours_server.log"; fi
kill -TERM $BP 2>/dev/null; wait $BP 2>/dev/null
python3 - "$W" "$REPS" <<'PY' | tee "$W/chat_summary.txt"
import glob, json, os, statistics, sys
w, reps = sys.argv[1], int(sys.argv[2])
out = {"bench": "chat_gpu_vs_vllm", "runs_per_system": reps, "systems": {}}
for system in ("vllm", "ours"):
    runs = []
    for r in range(1, reps + 1):
        f = os.path.join(w, f"chat_{system}_r{r}.json")
        if os.path.exists(f):
            runs += json.load(open(f))["runs"]
    if not runs:
        continue
    out["systems"][system] = {
        "runs": len(runs),
        "ttft_p50_s_median": statistics.median(x["ttft_p50_s"] for x in runs),
        "output_tokens_per_s_median": statistics.median(x["output_tokens_per_s"] for x in runs),
        "ttft_p50_s": [x["ttft_p50_s"] for x in runs],
        "output_tokens_per_s": [x["output_tokens_per_s"] for x in runs],
        "prefix_cache_hit_rate": [x.get("prefix_cache_hit_rate") for x in runs],
        "workload": json.load(open(os.path.join(w, f"chat_{system}_r1.json"))).get("workload")}
s = out["systems"]
if "vllm" in s and "ours" in s:
    out["ttft_p50_vllm_over_ours"] = s["vllm"]["ttft_p50_s_median"] / s["ours"]["ttft_p50_s_median"]
    out["output_tps_ours_over_vllm"] = (s["ours"]["output_tokens_per_s_median"]
                                        / s["vllm"]["output_tokens_per_s_median"])
print("| server (prefix caching on) | TTFT p50, median of runs | output tok/s, median | hit rate per run |")
print("|---|---|---|---|")
for k, v in s.items():
    print(f"| {k} | {v['ttft_p50_s_median'] * 1000:.1f} ms | {v['output_tokens_per_s_median']:,.0f} | "
          f"{v['prefix_cache_hit_rate']} |")
if "ttft_p50_vllm_over_ours" in out:
    print(f"TTFT p50: vLLM / ours = {out['ttft_p50_vllm_over_ours']:.2f} (>= 1: ours at least as fast); "
          f"output tok/s: ours / vLLM = {out['output_tps_ours_over_vllm']:.2f}")
json.dump(out, open(os.path.join(w, "chat_summary.json"), "w"), indent=1)
PY
cp "$W/chat_summary.json" "$W/chat_summary.txt" "$DEST/" 2>/dev/null
tar czf "$DEST/chat_all.tgz" -C "$W" .
