# structured A/B on the H200: A = main 664f8c0 (.carry/old), B = the tree. Run from /tmp so that `python -m` imports
# the package on PYTHONPATH, not the working directory's (the earlier A/Bs ran the tree for both)
source .carry/a/steps.sh; [ -d /tmp/site ] || ga >/dev/null; machine | tee $OUT/machine.txt
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=$PWD; M=/tmp/model-llama-1b
[ -d $M ] || PYTHONPATH=$R:/tmp/site python3 bench/make_random_model.py --shape llama-1b --tok /tmp/assets/tok --out $M --device cuda > $OUT/make.log 2>&1 || { tail $OUT/make.log; exit 1; }
printf '[kv_cache]\nprefix_caching = false\n' > /tmp/ours.toml
one() {  # tag code repeats
  echo "== $1 $(date +%T) $(cd /tmp && PYTHONPATH=$2:/tmp/site python3 -c 'import bucketserve; print(bucketserve.__file__)')"
  (cd /tmp && PYTHONPATH=$2:/tmp/site timeout 200 python3 $R/bench/structured_gpu.py --repeats $3 --out $OUT/structured_$1.json \
    --base-url http://127.0.0.1:8200 --server-cmd "python3 -m bucketserve.server.cli serve --model $M \
    --embedding-model none --device cuda --port 8200 --buckets /tmp/ours.toml" > $OUT/server_$1.log 2>&1)
  grep -h "tok_s_ratio\|^plain:\|errors" $OUT/server_$1.log | head -5 | cut -c1-300
}
one A1 $R/.carry/old 3
one B1 $R 3
one B2 $R 3
one A2 $R/.carry/old 3
echo "== gpu tests $(date +%T)"
PYTHONPATH=/tmp/site:$R SMOLLM2_TOKENIZER_DIR=/tmp/assets/tok timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_structured_gpu.py tests/test_engine_gpu.py tests/test_cuda_graphs_gpu.py tests/test_mixed_graphs.py tests/test_piecewise_graphs.py tests/test_prefix_caching_gpu.py tests/test_kernels_gpu.py 2>&1 | tail -3
cd $OUT && tar czf /tmp/r7.tgz . && mv /tmp/r7.tgz $OUT/
