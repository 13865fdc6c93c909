#!/usr/bin/env bash
# GPU embeddings, issue 10's must-shows in one command, one system after the other on one machine:
#   1. offline (20,000 seeded texts, tokenization counted): bucketserve, sentence-transformers fp16
#      (best of batch 32/128/512), vLLM LLM.embed; min cosine of each against ST fp32 over the corpus
#   2. every captured (batch, length) shape with padding rows, and the eager forward, against ST fp32
#   3. online over HTTP (64 clients x 1 text, 16 clients x 32 texts): `bucketserve serve --device cuda`,
#      then vLLM's OpenAI server (--runner pooling), the same client
#   4. a summary table ($OUT/emb_summary.json, .txt)
#
#   EMB_MODEL_DIR=DIR TOK=DIR VLLM_SITE=DIR OUT=DIR bash bench/embeddings_gpu_vs_vllm.sh
# EMB_MODEL_DIR: all-MiniLM-L6-v2 as a Hugging Face / sentence-transformers directory, float32 weights
#   (the cosine oracle is ST in float32; every system casts to float16 itself).
# TOK: SmolLM2's tokenizer.json / tokenizer_config.json / config.json: `bucketserve serve` also loads
#   a generative model, here the SmolLM2-135M shape with random weights (idle during the run).
# VLLM_SITE: vLLM 0.25.1 and its server's dependencies (pip install --target); given to vLLM's
#   processes only. SITE (default VLLM_SITE): fastapi / uvicorn / sse-starlette for bucketserve's server.
# Everything is written under WORK (/tmp/emb_work); OUT gets emb_summary.json / .txt and all of WORK
# as emb_all.tgz (the device tool brings back at most 8 files). SKIP_VLLM=1 skips vLLM; SKIP_ST=1 sentence-transformers; N (20000), ROUND_S (5) seconds per online round (3 rounds per shape, the median reported);
# PARTS ("offline shapes online"): the parts to run (the summary reads every part's JSON in WORK, so
# two calls on one machine, e.g. PARTS="offline shapes" then PARTS=online, give one table);
# DTYPE float16; ST_BATCHES (32,128,512); REPEATS (3) timed offline runs per system;
# EMB_API_WORKERS (4): `bucketserve serve --api-workers` for the online part (each worker its own
# encoder, graphs and batcher; 1 = the single-process server).
set -u
ROOT=$(pwd); DEST=${OUT:-/tmp/emb}; OUT=${WORK:-/tmp/emb_work}; N=${N:-20000}; SECONDS_PER=${ROUND_S:-5}; DTYPE=${DTYPE:-float16}
SITE=${SITE:-${VLLM_SITE:-}}; M=/tmp/model-smollm2-135m-emb
mkdir -p "$OUT" "$DEST"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 EMB_MODEL_DIR
export PYTHONPATH="$ROOT${SITE:+:$SITE}"
B="python3 $ROOT/bench/embeddings_gpu.py"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/emb_machine.txt" 2>&1
grep -m1 "model name" /proc/cpuinfo >> "$OUT/emb_machine.txt"; nproc >> "$OUT/emb_machine.txt"

PARTS=${PARTS:-offline shapes online}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
systems=bucketserve; [ -z "${SKIP_ST:-}" ] && systems=$systems,st
vl=""; [ -z "${SKIP_VLLM:-}" ] && [ -n "${VLLM_SITE:-}" ] && vl=--vllm
if has offline; then
echo "== offline ($systems ${vl:+vllm})"
$B offline --n "$N" --dtype "$DTYPE" --systems "$systems" $vl --repeats "${REPEATS:-3}" \
  --st-batches "${ST_BATCHES:-32,128,512}" --json "$OUT/emb_offline.json" \
  > "$OUT/emb_offline.log" 2>&1 || tail -20 "$OUT/emb_offline.log"
grep -E "^(bucketserve|st|vllm):|tokenizer " "$OUT/emb_offline.log" | cut -c1-400
fi

if [ -z "${SKIP_ST:-}" ] && has shapes; then
  echo "== every captured shape vs ST fp32"
  $B shapes --n "$N" --dtype "$DTYPE" --json "$OUT/emb_shapes.json" > "$OUT/emb_shapes.log" 2>&1 \
    || tail -20 "$OUT/emb_shapes.log"
fi

if has online; then
echo "== online: bucketserve serve --api-workers ${EMB_API_WORKERS:-4}"
python3 - "$TOK" "$M" <<'PY'
import os, shutil, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
tok, d = sys.argv[1:]
os.makedirs(d, exist_ok=True)
for f in os.listdir(tok):
    shutil.copy(os.path.join(tok, f), d)
cfg = LlamaConfig.from_pretrained(d)
cfg.tie_word_embeddings = True
torch.manual_seed(0)
with torch.device("cuda"):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(d)
PY
$B online --launch --n "$N" --seconds "$SECONDS_PER" --json "$OUT/emb_online_ours.json" \
  --serve-args --model "$M" --embedding-model "$EMB_MODEL_DIR" --embedding-dtype "$DTYPE" \
  --api-workers "${EMB_API_WORKERS:-4}" \
  > "$OUT/emb_online_ours.log" 2>&1 || tail -30 "$OUT/emb_online_ours.log"
grep '"clients"' "$OUT/emb_online_ours.log"

if [ -n "$vl" ]; then
  echo "== online: vLLM's server"
  PYTHONPATH=$VLLM_SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
    python3 -m vllm.entrypoints.openai.api_server --model "$EMB_MODEL_DIR" --served-model-name minilm \
    --runner pooling --dtype "$DTYPE" --port 8100 --gpu-memory-utilization 0.5 \
    > "$OUT/emb_vllm_server.log" 2>&1 &
  VP=$!
  $B online --base-url http://127.0.0.1:8100 --model minilm --n "$N" --seconds "$SECONDS_PER" \
    --json "$OUT/emb_online_vllm.json" > "$OUT/emb_online_vllm.log" 2>&1 \
    || { tail -20 "$OUT/emb_online_vllm.log"; tail -30 "$OUT/emb_vllm_server.log"; }
  grep '"clients"' "$OUT/emb_online_vllm.log"
  kill $VP 2>/dev/null; wait $VP 2>/dev/null
fi
fi

echo "== summary"
$B summary --summary-dir "$OUT" --json "$OUT/emb_summary.json" > "$OUT/emb_summary.log" 2>&1
python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/emb_summary.json" \
  | tee "$OUT/emb_summary.txt"; cat "$OUT/emb_machine.txt"
cp "$OUT/emb_summary.json" "$OUT/emb_summary.txt" "$DEST/" 2>/dev/null
tar czf "$DEST/emb_all.tgz" -C "$OUT" .
