# FP8 decode attention: more tile configs (fp8 pool only); the fp8kv decode step's kernel profile at batch 256 with the new defaults
source .carry/a/steps.sh; [ -d /tmp/site ] || ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 bench/fp8_attention_gpu.py --out $OUT --pools fp8 --cases 256x512,64x512,256x2048 \
  --configs n64w2s4,n64w1s4,n32w1s4,n32w2s4,n64w2s5,n64w2s3,n32w2s3,n128w2s4,n64w1s3,n16w1s4 > $OUT/att.log 2>&1
grep "dot=fp16" $OUT/att.log | sed "s/.*batch=//; s/bound_us.*us=/us=/" | cut -c1-120
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 bench/gpu_8b.py --out $OUT/p --modes fp8kv --requests "" --batches 256 --profile > $OUT/prof.log 2>&1
grep -A3 "^decode\|wall" $OUT/prof.log | cut -c1-400
cd $OUT && tar czf /tmp/r8.tgz . && mv /tmp/r8.tgz $OUT/
