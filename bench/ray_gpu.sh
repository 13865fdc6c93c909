#!/usr/bin/env bash
# Issue 29 (Ray Serve scale-out) must-shows 4 and 5: the plain `bucketserve serve` against the
# Ray Serve endpoint (`serve --replicas N`), the same random-weight model, the same 1,024-request
# mixed workload (prompts log-uniform 16..1024 token ids, max_tokens uniform 16..256, EOS
# ignored, seed 0), the same load client (`bucketserve bench`, closed loop), REPS timed runs
# each after one warm-up; per shape:
#   plain1  the single server (one GPU), one HTTP front end (--api-workers 1): a Ray replica runs
#           the app in one process, so this is "the same front-end setting" of must-show 4
#   plain   the single server with its default front ends (--api-workers auto): its best
#   ray1    Ray Serve, 1 replica on the GPU                       (must-show 4: >= 0.9x plain1)
#   ray1s   ray1 with --stream-batch-ms SLOW_MS (default 20): fewer, fuller Ray stream items
#   ray2    Ray Serve, 2 replicas sharing the one GPU (0.5 each, KV pools 0.45 of it each)
#   rayh1   ray1 with --ray-ingress haproxy: Ray Serve's HAProxy direct ingress, no Python hop
#   rayh2   ray2 with --ray-ingress haproxy
#   raygpus Ray Serve, one replica per GPU of the machine, at C x GPUs streams (must-show 5:
#           >= 0.9 x GPUs x ray1); skipped on a one-GPU machine
#
#   TOK=DIR OUT=DIR [SHAPES="llama-1b llama-8b smollm2-135m"] [SYSTEMS="plain1 plain ray1 ray2 raygpus"]
#     [C=256] [N=1024] [REPS=3] bash bench/ray_gpu.sh
#
# TOK: SmolLM2's config.json / tokenizer.json / tokenizer_config.json (no weights: random bf16
#   weights of each shape are made here). Run from the repository root; the repository goes first
#   on PYTHONPATH. Needs ray[serve] 2.60 on the GPU machine: carry the cp312 manylinux wheels
#   (ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl, about 70 MB: split in pieces like the other
#   large wheels) and its serve extra's pure-Python dependencies, docs/ray.md lists them;
#   install with `pip install --no-index --no-deps --target /tmp/site *.whl`.
# DEV=cpu: the same flow on a CPU with tiny settings (a dry run of the script; also the CPU
#   overhead figure of docs/ray.md): DEV=cpu SHAPES=smollm2-135m N=32 C=8 OUTPUT_LEN=16 REPS=3.
# Output: OUT/{system}_{shape}_c{C}_r{rep}.json (bench --out), server logs, summary_{shape}.json
#   (bench/summarize_online.py) and OUT/ray_gpu_summary.txt (ratios; printed at the end).
set -u
ROOT=$(pwd); DEV=${DEV:-cuda}; OUT=${OUT:-/tmp/ray_gpu}; N=${N:-1024}; C=${C:-256}; REPS=${REPS:-3}
SHAPES=${SHAPES:-llama-1b llama-8b smollm2-135m}; SYSTEMS=${SYSTEMS:-plain1 plain ray1 ray2 raygpus}
SLOW_MS=${SLOW_MS:-20}
WARMUP=${WARMUP:-64}; WORKERS=${WORKERS:-4}; OUTPUT_LEN=${OUTPUT_LEN:-uniform:16:256}
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
NGPU=1; [ "$DEV" = cuda ] && NGPU=$(nvidia-smi -L | wc -l)
W="$OUT/workload.jsonl"
python3 -m bucketserve.server.cli bench --dry-run --num-requests "$N" --seed 0 --prompt-kind ids \
  --prompt-len loguniform:16:1024 --output-len "$OUTPUT_LEN" --save-trace "$W" || exit 1


up() {  # port pid: the model answers (a Ray endpoint: every replica has loaded)
  for _ in $(seq 1 900); do
    if curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1; then
      want=${3:-0}; [ "$want" -le 1 ] && return 0
      got=$(curl -sf "http://127.0.0.1:$1/metrics" | grep -o 'replica="[^"]*"' | sort -u | wc -l)
      [ "$got" -ge "$want" ] && return 0
    fi
    kill -0 "$2" 2>/dev/null || return 1; sleep 1; done; return 1; }

for SHAPE in $SHAPES; do
  M=/tmp/model-$SHAPE; python3 bench/make_random_model.py --shape "$SHAPE" --tok "$TOK" --out "$M" --device "$DEV" || exit 1
  for SYS in $SYSTEMS; do
    B="$OUT/$SYS.toml"; printf '[kv_cache]\nprefix_caching = false\n' > "$B"  # the runs repeat prompts
    ARGS=(); CONC=$C; REPL=0
    case $SYS in
      plain) ARGS=(--api-workers auto) ;;
      plain1) ARGS=(--api-workers 1) ;;
      ray1) ARGS=(--replicas 1); REPL=1 ;;
      ray1s) ARGS=(--replicas 1 --stream-batch-ms "$SLOW_MS"); REPL=1 ;;
      ray2) ARGS=(--replicas 2 --gpus-per-replica 0.5); REPL=2
            printf 'gpu_memory_fraction = 0.45\n' >> "$B" ;;
      rayh1) ARGS=(--replicas 1 --ray-ingress haproxy); REPL=1 ;;
      rayh2) ARGS=(--replicas 2 --gpus-per-replica 0.5 --ray-ingress haproxy); REPL=2
            printf 'gpu_memory_fraction = 0.45\n' >> "$B" ;;
      raygpus) [ "$NGPU" -gt 1 ] || { echo "raygpus: one GPU only, skipped"; continue; }
            ARGS=(--replicas "$NGPU" --gpus-per-replica 1); REPL=$NGPU; CONC=$((C * NGPU)) ;;
    esac
    # Ray sets OMP_NUM_THREADS to a replica's CPUs: give each its share of the cores
    [ "$DEV" = cpu ] && [ "$REPL" -gt 0 ] && ARGS+=(--cpus-per-replica $(( $(nproc) / REPL )))
    LOG="$OUT/${SYS}_${SHAPE}_server.log"
    python3 -m bucketserve.server.cli serve --device "$DEV" --model "$M" --embedding-model none \
      --buckets "$B" --host 127.0.0.1 --port 8300 "${ARGS[@]}" > "$LOG" 2>&1 &
    SP=$!
    if up 8300 $SP "$REPL"; then
      for r in $(seq 1 "$REPS"); do
        w=$WARMUP; [ "$r" -gt 1 ] && w=0
        python3 -m bucketserve.server.cli bench --base-url http://127.0.0.1:8300 --workload "$W" \
          --concurrency "$CONC" --warmup "$w" --workers "$WORKERS" --label "$SYS" \
          --out "$OUT/${SYS}_${SHAPE}_c${CONC}_r$r.json" > "$OUT/${SYS}_${SHAPE}_c${CONC}_r$r.log" 2>&1 \
          || tail -3 "$OUT/${SYS}_${SHAPE}_c${CONC}_r$r.log"
      done
    else
      echo "$SYS $SHAPE: the server did not come up"; tail -20 "$LOG"
    fi
    kill -TERM $SP 2>/dev/null; wait $SP 2>/dev/null
  done
  python3 bench/summarize_online.py "$OUT" "$SHAPE" > "$OUT/summary_${SHAPE}.txt"; cat "$OUT/summary_${SHAPE}.txt"
done

python3 - "$OUT" "$NGPU" $SHAPES <<'PY' | tee "$OUT/ray_gpu_summary.txt"
import json, os, sys
out, ngpu, shapes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for shape in shapes:
    path = os.path.join(out, f"summary_{shape}.json")
    if not os.path.exists(path):
        continue
    rows = {r["system"]: r for r in json.load(open(path))["rows"]}
    def line(name, a, b, factor=1.0):
        if a in rows and b in rows:
            ra, rb = rows[a], rows[b]
            print(f"{shape}: {name} {ra['output_tok_s'] / (rb['output_tok_s'] * factor):.2f}x "
                  f"(out tok/s {ra['output_tok_s']:.0f} vs {rb['output_tok_s']:.0f}; TTFT p50 "
                  f"{ra['ttft_p50_ms']:.0f} vs {rb['ttft_p50_ms']:.0f} ms; ITL p50 "
                  f"{ra['itl_p50_ms']:.1f} vs {rb['itl_p50_ms']:.1f} ms; errors "
                  f"{ra['errors']} / {rb['errors']})")
    line("ray 1 replica / plain, 1 front end", "ray1", "plain1")
    line("ray 1 replica, slow stream batches / plain, 1 front end", "ray1s", "plain1")
    line("ray 1 replica / plain, auto front ends", "ray1", "plain")
    line("ray 1 replica, haproxy ingress / plain, 1 front end", "rayh1", "plain1")
    line("ray 2 replicas on one GPU, haproxy ingress / plain", "rayh2", "plain")
    line("ray 2 replicas on one GPU / plain", "ray2", "plain")
    line("ray 2 replicas on one GPU, haproxy ingress / plain, 1 front end", "rayh2", "plain1")
    line(f"ray {ngpu} GPUs / ({ngpu} x ray 1 replica)", "raygpus", "ray1", ngpu)
PY
