# 8B offline on the H200 (issue 28 must-show 2): bf16 (graphs), FP8 weights, FP8 weights + KV, each in its own process; then the FP8/gemv/kernel GPU tests
source .carry/a/steps.sh; [ -d /tmp/site ] || ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for m in graphs fp8 fp8kv; do
  echo "== $m $(date +%T)"
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 bench/gpu_8b.py --out $OUT/$m --modes $m --requests 256,1024 --repeats 3 --batches 1,256 > $OUT/$m.log 2>&1
  grep -h "^llama-8b\|^decode" $OUT/$m.log
done
echo "== gpu tests $(date +%T)"
PYTHONPATH=/tmp/site:$PWD SMOLLM2_TOKENIZER_DIR=/tmp/assets/tok timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gpu.py tests/test_gemv_gpu.py 2>&1 | tail -3
cd $OUT && tar czf /tmp/r6.tgz . && mv /tmp/r6.tgz $OUT/
