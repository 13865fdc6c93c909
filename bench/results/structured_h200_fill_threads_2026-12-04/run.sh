# fill threads of GrammarMasks' BatchGrammarMatcher on the H200: T8 (as shipped on 16 cores), T1, T2, T4, T8
source .carry/a/steps.sh; ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
M=/tmp/model-llama-1b
PYTHONPATH=$PWD:/tmp/site python3 bench/make_random_model.py --shape llama-1b --tok /tmp/assets/tok --out $M --device cuda > $OUT/make.log 2>&1 || { tail $OUT/make.log; exit 1; }
printf '[kv_cache]\nprefix_caching = false\n' > /tmp/ours.toml
for n in 1 2 4 8; do
  mkdir -p /tmp/t$n && cp -r bucketserve /tmp/t$n/
  python3 - /tmp/t$n/bucketserve/engine/structured.py $n <<'PY'
import sys
p, n = sys.argv[1], sys.argv[2]; s = open(p).read()
old = "xgr.BatchGrammarMatcher(min(8, max(1, (os.cpu_count() or 2) // 2)))"
assert old in s; open(p, "w").write(s.replace(old, f"xgr.BatchGrammarMatcher({n})"))
PY
done
one() {
  local tag=$1 code=$2
  echo "== $tag $(date +%T)"
  PYTHONPATH=$code:/tmp/site timeout 150 python3 bench/structured_gpu.py --repeats 3 --out $OUT/structured_$tag.json \
    --base-url http://127.0.0.1:8200 --server-cmd "python3 -m bucketserve.server.cli serve --model $M \
    --embedding-model none --device cuda --port 8200 --buckets /tmp/ours.toml" > $OUT/server_$tag.log 2>&1
  grep -h "tok_s_ratio\|^plain:\|core loop" $OUT/server_$tag.log
}
one T8a /tmp/t8; one T1 /tmp/t1; one T2 /tmp/t2; one T4 /tmp/t4; one T8b /tmp/t8
