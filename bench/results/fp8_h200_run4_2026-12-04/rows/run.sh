# FP8 few-row products: decode steps fp8kv at batch 2..64 with rows_fp8 (B) and without (A, --no-fp8-rows), one command; GPU tests of gemv and fp8
source .carry/a/steps.sh; [ -d /tmp/site ] || ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for v in B A; do
  echo "== $v $(date +%T)"
  F=""; [ $v = A ] && F="--no-fp8-rows"
  PYTHONPATH=$PWD:/tmp/site timeout 120 python3 bench/gpu_8b.py --out $OUT/$v --modes fp8kv --requests "" --batches 2,8,16,32,64 $F > $OUT/$v.log 2>&1
  grep "^decode" $OUT/$v.log
done
python3 - $OUT/B/gpu_8b.json <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))["env"]["cuda_info"]["fp8kv"].get("gemv", {})
for k, v in g.items():
    if "rows" in k: print(k, v.get("choice"), {b: (r.get("cublas_us"), r.get("gemv_us"), r.get("config")) for b, r in v.get("bands", {}).items()})
PY
echo "== gpu tests $(date +%T)"
PYTHONPATH=/tmp/site:$PWD SMOLLM2_TOKENIZER_DIR=/tmp/assets/tok timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_gpu.py tests/test_fp8_gpu.py 2>&1 | tail -4
cd $OUT && tar czf /tmp/r9.tgz . && mv /tmp/r9.tgz $OUT/
