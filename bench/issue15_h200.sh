#!/usr/bin/env bash
# Issue 15 on one GPU in one call: must-show 1 (tuned buckets vs the shipped default on the skewed
# trace: padding, throughput, plots; bench/bucket_tuning.py) and must-show 3 (embeddings under a
# Poisson sweep, the feedback loop against fixed delays: p99 vs the SLO and throughput per rate;
# bench/embedding_slo_sweep.py). Sized to about 6 minutes on an H200 with the defaults below.
#
#   OUT=DIR TOK=.gpuassets/smollm2-tok EMB_DIR=.gpuassets/minilm bash bench/issue15_h200.sh
#
# Run from the repository root with fastapi / uvicorn / ... on PYTHONPATH (carried wheels
# installed with `pip install --no-index --no-deps --target /tmp/site`: README, "Deadline-driven
# batching vs fixed delays"); the script puts the repository first on PYTHONPATH.
# TOK: SmolLM2's config.json / tokenizer.json / tokenizer_config.json: the served generative model
#   is the SmolLM2-135M shape with random weights (made here; no weights travel).
# EMB_DIR: an all-MiniLM-L6-v2 sentence-transformers directory. Without model.safetensors in it
#   (only config, tokenizer, modules.json, 1_Pooling), random weights of its BERT shape are made
#   here: the encoder's cost does not depend on its weights' values.
# DEV=cpu: the same flow with tiny settings on a CPU (a dry run of the script itself).
# Knobs: PARTS ("tune sweep"), RATES, FIXED_MS, SLO_MS, DUR_S, MIN_REQ, MAX_REQ, CLIENTS (sweep
#   client processes), TUNE_REQ / TUNE_RATE / TUNE_CONC (trace size, its Poisson rate, closed-loop
#   concurrency), CLOSED_RUNS (closed-loop runs per configuration: the median is compared),
#   ROUNDS (sweep rounds per (setting, rate): the verdict is on the medians).
#   ABBA (bucket tuning: rounds of fresh default and tuned servers in A B B A order),
#   OUT_LEN (bucket tuning: the trace's output tokens per request; longer closed runs).
# Output: $OUT/issue15_summary.txt (also printed at the end), embedding_slo_sweep_$DEV.json/.png,
#   bucket_tuning_summary.json, tuned.toml, padding_default.png / padding_tuned.png, and
#   issue15_all.tgz (everything: logs, request logs, all plots). Work files in WORK (/tmp/issue15).
set -u
ROOT=$(pwd); DEV=${DEV:-cuda}; OUT=${OUT:-/tmp/issue15_out}; W=${WORK:-/tmp/issue15}
mkdir -p "$OUT" "$W"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PARTS=${PARTS:-tune sweep}; ROUNDS=${ROUNDS:-1}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
if [ "$DEV" = cuda ]; then
  RATES=${RATES:-10,100,500,1000,2000}; FIXED_MS=${FIXED_MS:-0,2,5,20}; SLO_MS=${SLO_MS:-50}
  DUR_S=${DUR_S:-2.5}; MIN_REQ=${MIN_REQ:-40}; MAX_REQ=${MAX_REQ:-3000}; CLIENTS=${CLIENTS:-4}
  TUNE_REQ=${TUNE_REQ:-240}; TUNE_RATE=${TUNE_RATE:-12}; TUNE_CONC=${TUNE_CONC:-64}
  TUNE_LIMIT=${TUNE_LIMIT:-240}; SWEEP_LIMIT=${SWEEP_LIMIT:-300}; CLOSED_RUNS=${CLOSED_RUNS:-3}
else
  RATES=${RATES:-10,200}; FIXED_MS=${FIXED_MS:-0,5,50}; SLO_MS=${SLO_MS:-500}
  DUR_S=${DUR_S:-1}; MIN_REQ=${MIN_REQ:-10}; MAX_REQ=${MAX_REQ:-40}; CLIENTS=${CLIENTS:-1}
  TUNE_REQ=${TUNE_REQ:-12}; TUNE_RATE=${TUNE_RATE:-4}; TUNE_CONC=${TUNE_CONC:-4}
  TUNE_LIMIT=${TUNE_LIMIT:-600}; SWEEP_LIMIT=${SWEEP_LIMIT:-600}; CLOSED_RUNS=${CLOSED_RUNS:-1}
fi
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  grep -m1 "model name" /proc/cpuinfo; nproc; python3 -c "import torch; print('torch', torch.__version__)"
} > "$W/machine.txt" 2>&1

# ---------------------------------------------------------------- models (random weights, real shapes)
M=$W/model-smollm2-135m; E=$W/minilm
el "models"
python3 - "${TOK:?TOK: SmolLM2 tokenizer/config directory}" "$M" "${EMB_DIR:?EMB_DIR: MiniLM directory}" "$E" "$DEV" <<'PY' || exit 1
import os, shutil, sys, torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM
tok, m, emb, e, dev = sys.argv[1:]
os.makedirs(m, exist_ok=True)
for f in os.listdir(tok):
    if os.path.isfile(os.path.join(tok, f)):
        shutil.copy(os.path.join(tok, f), m)
cfg = LlamaConfig.from_pretrained(m)
cfg.tie_word_embeddings = True
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32).save_pretrained(m)
if os.path.exists(os.path.join(emb, "model.safetensors")):
    if os.path.lexists(e):
        os.remove(e)
    os.symlink(os.path.abspath(emb), e)
    print("embedding model: the weights in", emb)
else:
    shutil.copytree(emb, e, dirs_exist_ok=True)
    BertModel(BertConfig.from_pretrained(e), add_pooling_layer=False).save_pretrained(e)
    print("embedding model: random weights of", emb, "'s BERT shape")
PY
SERVE="--model $M --embedding-model $E"

# ---------------------------------------------------------------- must-show 1: tuned vs default buckets
if has tune; then
  el "bucket tuning ($TUNE_REQ requests at $TUNE_RATE/s, closed loop at $TUNE_CONC)"
  timeout -k 60 "$TUNE_LIMIT" python3 "$ROOT/bench/bucket_tuning.py" --device "$DEV" --out-dir "$W/bucket_tuning" \
    --requests "$TUNE_REQ" --rate "$TUNE_RATE" --concurrency "$TUNE_CONC" --closed-runs "$CLOSED_RUNS" --abba-rounds "${ABBA:-0}" --output-len "${OUT_LEN:-16}" \
    --serve-args "$SERVE" --request-embedding-model "" > "$W/bucket_tuning.log" 2>&1 \
    || { echo "bucket_tuning failed or timed out:"; tail -25 "$W/bucket_tuning.log"; }
  for s in "$W"/bucket_tuning/server_*.log; do [ -f "$s" ] && grep -iE "error|traceback" "$s" | head -5; done
fi

# ---------------------------------------------------------------- must-show 3: the SLO sweep
if has sweep; then
  el "SLO sweep (rates $RATES, SLO $SLO_MS ms, fixed $FIXED_MS ms)"
  timeout -k 60 "$SWEEP_LIMIT" python3 "$ROOT/bench/embedding_slo_sweep.py" --device "$DEV" --rates "$RATES" \
    --slo-ms "$SLO_MS" --fixed-ms "$FIXED_MS" --duration-s "$DUR_S" --min-requests "$MIN_REQ" \
    --max-requests "$MAX_REQ" --workers "$CLIENTS" --serve-args "$SERVE" --request-model "" --rounds "$ROUNDS" \
    --out "$W/embedding_slo_sweep_$DEV.json" > "$W/slo_sweep.log" 2>&1 \
    || { echo "SLO sweep failed or timed out (partial JSON kept):"; tail -25 "$W/slo_sweep.log"; }
  grep -E "^ *(feedback|fixed=)" "$W/slo_sweep.log" | cut -c1-160
fi

# ---------------------------------------------------------------- summary and files
el "summary"
python3 - "$W" "$DEV" > "$W/issue15_summary.txt" 2>&1 <<'PY'
import json, os, sys
w, dev = sys.argv[1:]
print(open(os.path.join(w, "machine.txt")).read().strip())
p = os.path.join(w, "bucket_tuning", "summary.json")
if os.path.exists(p):
    s = json.load(open(p))
    print("\nmust-show 1: shipped default vs tuned buckets (skewed trace)")
    print(f"{'run':16} {'out tok/s':>10} {'req/s':>7} {'emb in/s':>9} {'LLM pad':>8} {'emb pad':>8} "
          f"{'emb batches':>11} {'TTFT p50':>9} {'E2E p50':>9} errors")
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for run, r in s["brief"].items():
        print(f"{run:16} {f(r['output_tok_s']):>10} {f(r['req_s'], 2):>7} "
              f"{f(r['embedding_inputs_s']):>9} {f(r['engine_padding'], 3):>8} "
              f"{f(r['embedding_padding'], 3):>8} {f(r['embedding_batches'], 0):>11} "
              f"{f(r['ttft_p50_ms']):>9} {f(r['e2e_p50_ms']):>9} {r['errors']}")
    b = s["brief"]
    for kind in ("replay", "closed"):
        d, t = b[f"default_{kind}"], b[f"tuned_{kind}"]
        if d["output_tok_s"] and t["output_tok_s"]:
            print(f"{kind}: tuned / default output tok/s {t['output_tok_s'] / d['output_tok_s']:.3f}"
                  f" (runs: default {d.get('runs_output_tok_s')}, tuned {t.get('runs_output_tok_s')})")
    fid = s.get("replay_fidelity") or {}
    print("tuned.toml check rc", s.get("tuned_check_rc"), "; replay: KS", fid.get("ks"), "(1% critical",
          fid.get("ks_critical_1pct"), "), mean |gap diff|", fid.get("mean_abs_gap_diff_s"), "s")
else:
    print("\nmust-show 1: no bucket_tuning summary (see bucket_tuning.log)")
p = os.path.join(w, f"embedding_slo_sweep_{dev}.json")
if os.path.exists(p):
    r = json.load(open(p))
    print(f"\nmust-show 3: SLO sweep, SLO {r['slo_ms']} ms ({len(r['runs'])} runs)")
    for run in sorted(r["runs"], key=lambda x: (x["rate"], x["setting"])):
        sv = run["server"]
        print(f"{run['setting']:>9} {run['rate']:6g}/s n={run['requests']:5d} ok={run['completed']:5d} "
              f"thr={run['throughput_inputs_s']:8.1f}/s p99all={run['p99_all_ms'] if isinstance(run['p99_all_ms'], str) else round(run['p99_all_ms'], 1)} ms "
              f"batch={sv['mean_batch_size'] and round(sv['mean_batch_size'], 1)} misses={sv['deadline_misses']:.0f} "
              f"lag99={run['client_send_lag_p99_ms'] and round(run['client_send_lag_p99_ms'], 1)}")
    for v in r.get("verdict", []):
        print(f"rate {v['rate']:6g}: SLO ok {v['slo_ok']} (fb {v['feedback_meets_slo']}, any fixed "
              f"{v['any_fixed_meets_slo']}); thr vs best fixed ({v['best_fixed']}) "
              f"{v['throughput_ratio_vs_best_fixed']:.3f} ok {v['throughput_ok']}")
else:
    print("\nmust-show 3: no sweep JSON (see slo_sweep.log)")
PY
cat "$W/issue15_summary.txt"
cp "$W/issue15_summary.txt" "$OUT/"
[ -f "$W/embedding_slo_sweep_$DEV.json" ] && cp "$W/embedding_slo_sweep_$DEV.json" "$OUT/"
[ -f "$W/embedding_slo_sweep_$DEV.png" ] && cp "$W/embedding_slo_sweep_$DEV.png" "$OUT/"
B=$W/bucket_tuning
[ -f "$B/summary.json" ] && cp "$B/summary.json" "$OUT/bucket_tuning_summary.json"
[ -f "$B/tuned.toml" ] && cp "$B/tuned.toml" "$OUT/"
[ -f "$B/plots_default/padding_per_bucket.png" ] && cp "$B/plots_default/padding_per_bucket.png" "$OUT/padding_default.png"
[ -f "$B/plots_tuned/padding_per_bucket.png" ] && cp "$B/plots_tuned/padding_per_bucket.png" "$OUT/padding_tuned.png"
tar czf "$OUT/issue15_all.tgz" -C "$W" --exclude "model-smollm2-135m" --exclude "minilm" . 2>/dev/null
ls -la "$OUT"; el "done"
