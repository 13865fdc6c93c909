# 8B on the H200: FP8 decode-attention sweep; decode steps fp8kv at batch 1, 256: A = main, B = tree (+ the sweep's pick)
source .carry/a/steps.sh; [ -d /tmp/site ] || ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
echo "== sweep $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout 170 python3 bench/fp8_attention_gpu.py --out $OUT > $OUT/att.log 2>&1; tail -2 $OUT/att.log
PICK=$(python3 - "$OUT/fp8_attention.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["decode"] if "us" in r and r["pool"] == "fp8"
        and r["batch"] == 256 and r["ctx"] == 512 and r["splits"] == 1]
best = min(rows, key=lambda r: r["us"])
cfg = best["cfg"].replace(" ", "")
print(("f16," if best["dot"] == "fp16" else "") + cfg)
PY
)
echo "pick: $PICK"; echo "$PICK" > $OUT/pick.txt
grep -h "pool=fp8" $OUT/att.log | grep "batch=256 ctx=512" | sort -t= -k10 | head -3
for v in B A; do
  echo "== $v $(date +%T)"
  if [ $v = B ]; then P=$PWD; F="--fp8-decode $PICK"; else P=$PWD/.carry/old; F=""; fi
  PYTHONPATH=$P:$PWD/bench:/tmp/site timeout 150 python3 bench/gpu_8b.py --out $OUT/$v --modes fp8kv --requests "" --batches 1,64,256 $F > $OUT/$v.log 2>&1
  grep "^decode" $OUT/$v.log
done
echo "== gpu tests $(date +%T)"
PYTHONPATH=/tmp/site:$PWD SMOLLM2_TOKENIZER_DIR=/tmp/assets/tok timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gpu.py tests/test_gemv_gpu.py tests/test_kernels_gpu.py 2>&1 | tail -4
cd $OUT && tar czf /tmp/r4.tgz . && mv /tmp/r4.tgz $OUT/
