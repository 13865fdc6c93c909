source .carry/a/steps.sh; [ -d /tmp/site ] || ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/site:$PWD SMOLLM2_TOKENIZER_DIR=/tmp/assets/tok timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider -x --tb=line tests/test_gemv_gpu.py -k "rows" 2>&1 | tail -4
echo "== B $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout 80 python3 bench/gpu_8b.py --out $OUT/B --modes fp8kv --requests "" --batches 2,16,64 > $OUT/B.log 2>&1
grep "^decode" $OUT/B.log
