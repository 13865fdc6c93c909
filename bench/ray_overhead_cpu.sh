#!/usr/bin/env bash
# The Ray path's overhead on a CPU (docs/ray.md): the plain `bucketserve serve` and the Ray
# Serve endpoint with one replica (`--replicas 1 --cpus-per-replica $(nproc)`: the whole CPU,
# as the plain server has), both up at once, the same default model and client
# (`bucketserve bench`, closed loop), timed runs alternating plain / ray (A B A B ...) so that
# the machine's drift hits both alike; medians of REPS runs each.
#
#   OUT=DIR [N=16] [C=8] [REPS=3] bash bench/ray_overhead_cpu.sh
# Output: OUT/{plain,ray1}_cpu_c{C}_r{rep}.json, OUT/summary_cpu.json (bench/summarize_online.py),
#   OUT/ray_overhead_cpu.txt (the ratio; printed).
set -u
ROOT=$(pwd); OUT=${OUT:-/tmp/ray_overhead}; N=${N:-16}; C=${C:-8}; REPS=${REPS:-3}
mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
W="$OUT/workload.jsonl"
python3 -m bucketserve.server.cli bench --dry-run --num-requests "$N" --seed 0 --prompt-kind ids \
  --prompt-len loguniform:16:256 --output-len uniform:16:32 --save-trace "$W" || exit 1
printf '[kv_cache]\ncpu_memory_gib = 0.5\nprefix_caching = false\n' > "$OUT/b.toml"
COMMON=(--embedding-model none --buckets "$OUT/b.toml" --host 127.0.0.1)
python3 -m bucketserve.server.cli serve "${COMMON[@]}" --port 8310 > "$OUT/plain_server.log" 2>&1 &
PP=$!
python3 -m bucketserve.server.cli serve "${COMMON[@]}" --port 8311 --replicas 1 \
  --cpus-per-replica "$(nproc)" > "$OUT/ray1_server.log" 2>&1 &
RP=$!
up() { for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0
  sleep 1; done; return 1; }
if up 8310 && up 8311; then
  for r in $(seq 0 "$REPS"); do  # run 0: warm-up of both, not counted
    for s in plain:8310 ray1:8311; do
      name=${s%%:*}; port=${s##*:}; dest="$OUT/${name}_cpu_c${C}_r$r.json"; [ "$r" = 0 ] && dest="$OUT/warmup_$name.json"
      python3 -m bucketserve.server.cli bench --base-url "http://127.0.0.1:$port" --workload "$W" \
        --concurrency "$C" --warmup 0 --workers 1 --label "$name" --out "$dest" \
        > "$OUT/${name}_r$r.log" 2>&1 || tail -3 "$OUT/${name}_r$r.log"
    done
  done
fi
kill -TERM $PP $RP 2>/dev/null; wait $PP $RP 2>/dev/null
python3 bench/summarize_online.py "$OUT" cpu > /dev/null
python3 - "$OUT" <<'PY' | tee "$OUT/ray_overhead_cpu.txt"
import json, os, sys
rows = {r["system"]: r for r in json.load(open(os.path.join(sys.argv[1], "summary_cpu.json")))["rows"]}
p, r = rows["plain"], rows["ray1"]
for name, row in (("plain", p), ("ray 1 replica", r)):
    print(f"{name:14s} out {row['output_tok_s']:7.1f} tok/s (runs {[round(x, 1) for x in row['output_tok_s_all']]}) "
          f"TTFT p50 {row['ttft_p50_ms']:6.0f} ms  ITL p50 {row['itl_p50_ms']:6.1f} ms  errors {row['errors']}")
print(f"ray / plain output tok/s: {r['output_tok_s'] / p['output_tok_s']:.2f}x; TTFT p50 "
      f"{r['ttft_p50_ms'] - p['ttft_p50_ms']:+.0f} ms; ITL p50 {r['itl_p50_ms'] - p['itl_p50_ms']:+.1f} ms")
PY
