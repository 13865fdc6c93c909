# structured A/B on the H200: A = b8cc3a7 (.carry/old), B = the working tree; P = B under cProfile
source .carry/a/steps.sh; ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M=/tmp/model-llama-1b
PYTHONPATH=$PWD:/tmp/site python3 bench/make_random_model.py --shape llama-1b --tok /tmp/assets/tok --out $M --device cuda > $OUT/make.log 2>&1 || { tail $OUT/make.log; exit 1; }
printf '[kv_cache]\nprefix_caching = false\n' > /tmp/ours.toml
one() {  # tag code repeats [profile]
  local tag=$1 code=$2 reps=$3 mod=bucketserve.server.cli env=""
  if [ -n "${4:-}" ]; then mod=bucketserve.bench.hooks; fi
  echo "== $tag $(date +%T)"
  BUCKETSERVE_CORE_PROFILE=${4:-} PYTHONPATH=$code:/tmp/site timeout 200 python3 bench/structured_gpu.py --repeats $reps --out $OUT/structured_$tag.json \
    --base-url http://127.0.0.1:8200 --server-cmd "python3 -m $mod serve --model $M \
    --embedding-model none --device cuda --port 8200 --buckets /tmp/ours.toml" > $OUT/server_$tag.log 2>&1
  grep -h "tok_s_ratio\|^plain:\|core loop" $OUT/server_$tag.log
}
one A1 $PWD/.carry/old 3
one B1 $PWD 3
one P $PWD 1 $OUT/core_P.prof
one B2 $PWD 3
one A2 $PWD/.carry/old 3
python3 - <<'PY' > $OUT/profile_top.txt
import pstats, os
p = pstats.Stats(os.environ["OUT"] + "/core_P.prof")
p.sort_stats("tottime").print_stats(45)
p.sort_stats("cumulative").print_stats(60)
PY
head -90 $OUT/profile_top.txt | tail -60
