#!/usr/bin/env bash
# The H200 measurements issues 28 and 30 still wait for, in parts of under 10 minutes each.
#
# Built here first: `bash bench/gpu_assets.sh REV` (REV: the "A" of the A/B, the code before
# the change being measured). Each part is one device call from the repository root, with
# carry [".gpuassets"] (and, for accuracy, one ".gpuparts/gN" per call: see gpu_setup.sh):
#
#   PART=tests      bash bench/h200_pending.sh   # GPU tests of the FP8, GEMV, kernels, graphs,
#                                                # engine and structured-output files (~3 min)
#   PART=structured bash bench/h200_pending.sh   # issue 30 must-show 3: bench/structured_gpu.py,
#                                                # A = .gpuassets/old, B = the tree, A B B A (~6 min)
#   PART=fp8        bash bench/h200_pending.sh   # issue 28 must-show 2: 8B offline, bf16 graphs,
#                                                # FP8 weights + KV, and the same with
#                                                # --fp8-fast-accum (~8 min)
#   PART=accuracy   bash bench/h200_pending.sh   # issue 28 must-show 1 with fast accumulation
#                                                # (needs the joined GGUF: gguf_piece 0, 1, 2)
#   PART=gemm       bash bench/h200_pending.sh   # issue 28: FP8 GEMMs by row count, _scaled_mm
#                                                # against triton_fp8_gemm's tiles (~4 min)
#   PART=defer      bash bench/h200_pending.sh   # issue 28: 8B offline, bf16 graphs, FP8
#                                                # weights + KV with the deferred scales off
#                                                # (BUCKETSERVE_FP8_DEFER=0) and on (~9 min)
#   PART=pdl        bash bench/h200_pending.sh   # issue 28: programmatic dependent launch,
#                                                # its tests, bench/fp8_pdl_gpu.py and the 8B
#                                                # decode step A B B A, --pdl off / auto (~10 min:
#                                                # ORDER="A1 B1" then "B2 A2" in two calls)
#   PART=served     bash bench/h200_pending.sh   # issue 28 must-show 3: the 8B shape served,
#                                                # vLLM --quantization fp8 then ours (needs
#                                                # bench/vllm_parts.sh's pieces first, ~8 min)
#   PART=tuner      bash bench/h200_pending.sh   # issue 28 must-show 5: the bucket tuner, prefix
#                                                # caching off, closed runs of 64-token outputs,
#                                                # then A B B A rounds (~9 min)
#
# PART may name several parts, run in turn ("structured tests"). Each part works in
# /tmp/pending/<part>/ and keeps $OUT/<part>.tgz up to date after each of its runs (the device
# tool returns at most 8 files, and what is under $OUT when a call runs out of time).
# REPEATS (3), ORDER (structured: "A1 B1 B2 A2"; a run named F* is the tree with
# BUCKETSERVE_OVERLAP_FILL=1, e.g. ORDER="B1 F1 F2 B2"; the other letters: see the part) and
# the timeouts (T_TESTS, T_RUN) can be set in the environment.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_setup.sh || exit 1
PARTS_=${PART:?set PART to tests, structured, gemm, fp8, defer, pdl, accuracy, served or tuner}
REPEATS=${REPEATS:-3}
# tar exits 1 when a file changed while it read it (a server's log): the archive is still good
save() { tar czf "/tmp/pending/$PART.tgz" -C /tmp/pending "$PART"; [ $? -le 1 ] && mv "/tmp/pending/$PART.tgz" "$OUT/"; }
for PART in $PARTS_; do
O=/tmp/pending/$PART
mkdir -p "$O"
echo "=== $PART $(date +%T)"
machine | tee "$O/machine.txt"

case $PART in
tests)
  timeout "${T_TESTS:-400}" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/test_fp8_gpu.py tests/test_gemv_gpu.py tests/test_kernels_gpu.py \
    tests/test_cuda_graphs_gpu.py tests/test_mixed_graphs.py tests/test_piecewise_graphs.py \
    tests/test_engine_gpu.py tests/test_prefix_caching_gpu.py \
    tests/test_structured_gpu.py > "$O/pytest.log" 2>&1
  grep -h "fast accumulation" "$O/pytest.log"
  tail -3 "$O/pytest.log"
  ;;
structured)
  # xgrammar's batch fill of 128 rows on 1-8 of this host's threads (the engine uses
  # min(8, cores // 2)): whether its threads pay on a 16-core host
  # (FILL_BENCH=0 skips it, about a minute)
  [ "${FILL_BENCH:-1}" = 0 ] || for th in 1 2 4 8; do
    python3 bench/xgrammar_gil_cpu.py --tok "$TOK" --threads $th --calls 100 2>/dev/null | tail -1
  done | tee "$O/fill_threads.jsonl" | cut -c1-120
  M=/tmp/model-llama-1b
  [ -d $M ] || python3 bench/make_random_model.py --shape llama-1b --tok "$TOK" --out $M \
    --device cuda > "$O/make.log" 2>&1 || { tail "$O/make.log"; exit 1; }
  printf '[kv_cache]\nprefix_caching = false\n' > /tmp/ours.toml
  printf '[kv_cache]\nprefix_caching = false\n[structured]\nbackend = "llguidance"\n' > /tmp/ours_llg.toml
  # the host around each run: load, CPU steal (jiffies, cumulative) and bucketserve
  # processes left from an earlier run (schema runs varied 31-40k tok/s between servers)
  host() { echo "host $1: load $(cut -d' ' -f1-3 /proc/loadavg) steal $(awk '/^cpu /{print $9}' /proc/stat) left $(pgrep -fc 'bucketserve.server|bucketserve-' || true)"; }
  one() {  # tag code [VAR=VALUE ...]: the server's experiment switches (TRACE=1: see below)
    local tag=$1 code=$2; shift 2
    echo "== $tag $(date +%T) $(which_package "$code") ${*:-as shipped}"
    host before
    # TRACE=1: one run (not timed: the profiler slows it) whose core records 30 steps under
    # torch.profiler from the 301st with 96 guided sequences, past the ramp-up (bench/hooks.py)
    local mod=bucketserve.server.cli trace="" reps=$REPEATS
    [[ " $* " == *" TRACE=1 "* ]] && { mod=bucketserve.bench.hooks; trace=$O/trace_$tag.json.gz:96:30:300; reps=1; }
    (cd /tmp && env "$@" BUCKETSERVE_CORE_TRACE="$trace" PYTHONPATH="$code:/tmp/site" \
      timeout "${T_RUN:-150}" python3 "$R/bench/structured_gpu.py" \
      --repeats "$reps" --out "$O/structured_$tag.json" --base-url http://127.0.0.1:8200 \
      --server-cmd "python3 -m $mod serve --model $M --embedding-model none \
      --device cuda --port 8200 --buckets ${TOML:-/tmp/ours.toml}" > "$O/server_$tag.log" 2>&1)
    [ -z "$trace" ] || head -45 "$O/trace_$tag.json.gz.txt" 2>/dev/null | cut -c1-200
    host after
    grep -h "tok_s_ratio\|^plain:\|core loop" "$O/server_$tag.log" | cut -c1-300
    save
  }
  # A: .gpuassets/old; B: the tree; O: the tree, guided steps as before 2026-12-07
  # (BUCKETSERVE_OVERLAP_FILL=0); F: the tree, overlap_fill (=1); E: the tree, overlap_fill
  # started at the end of the previous call (=2); S: the tree, the next step scheduled and
  # prepared while the fill runs (=3, the default since 2026-12-07); T: the tree, the mask fill on
  # FILL_THREADS xgrammar threads (default 2); P: the tree, the engine core and the API workers
  # on the cores AFFINITY names (default 0-5/6-15); X: E, T (default 4) and P at once; R, Q: B
  # and S, traced (one untimed run each); J, I: B and S with the core's GIL switch interval at
  # SWITCH_US microseconds (default 200; Python's is 5,000); L: the tree with the llguidance
  # backend ([structured] backend = "llguidance"); V: the tree with the accepts on the fill
  # thread (=4, an experiment since 2026-12-08)
  fill=BUCKETSERVE_OVERLAP_FILL sw=BUCKETSERVE_SWITCH_INTERVAL_US
  for run in ${ORDER:-A1 B1 B2 A2}; do
    case $run in
      A*) one "$run" "$OLD" ;;
      O*) one "$run" "$R" $fill=0 ;;
      F*) one "$run" "$R" $fill=1 ;;
      E*) one "$run" "$R" $fill=2 ;;
      S*) one "$run" "$R" $fill=3 ;;
      T*) one "$run" "$R" BUCKETSERVE_FILL_THREADS="${FILL_THREADS:-2}" ;;
      P*) one "$run" "$R" BUCKETSERVE_CPU_AFFINITY="${AFFINITY:-0-5/6-15}" ;;
      X*) one "$run" "$R" $fill=2 BUCKETSERVE_FILL_THREADS="${FILL_THREADS:-4}" \
            BUCKETSERVE_CPU_AFFINITY="${AFFINITY:-0-5/6-15}" ;;
      R*) one "$run" "$R" TRACE=1 ;;
      Q*) one "$run" "$R" $fill=3 TRACE=1 ;;
      J*) one "$run" "$R" $sw="${SWITCH_US:-200}" ;;
      I*) one "$run" "$R" $fill=3 $sw="${SWITCH_US:-200}" ;;
      L*) TOML=/tmp/ours_llg.toml one "$run" "$R" ;;
      V*) one "$run" "$R" $fill=4 ;;
      *) one "$run" "$R" ;;
    esac
  done
  ;;
gemm)
  timeout "${T_RUN:-400}" python3 bench/fp8_gemm_gpu.py --json "$O/fp8_gemm.json" > "$O/fp8_gemm.log" 2>&1
  grep -v '^{"proj' "$O/fp8_gemm.log" | tail -12
  save
  ;;
fp8)
  for m in graphs fp8kv fp8kv_fast; do
    mode=${m%_fast}; extra=""
    [ "$m" = fp8kv_fast ] && extra=--fp8-fast-accum
    echo "== $m $(date +%T)"
    timeout "${T_RUN:-160}" python3 bench/gpu_8b.py --out "$O/$m" --modes $mode --requests 256,1024 \
      --repeats "$REPEATS" --batches 256 $extra > "$O/$m.log" 2>&1
    grep -h "^llama-8b\|^decode" "$O/$m.log"
    save
  done
  ;;
defer)
  for m in ${DEFER_RUNS:-graphs fp8kv_nodefer fp8kv}; do
    mode=${m%_nodefer}; d=1
    [ "$m" = fp8kv_nodefer ] && d=0
    echo "== $m $(date +%T)"
    BUCKETSERVE_FP8_DEFER=$d timeout "${T_RUN:-175}" python3 bench/gpu_8b.py --out "$O/$m" \
      --modes $mode --requests 256,1024 --repeats "$REPEATS" --batches 128,256 > "$O/$m.log" 2>&1
    grep -h "^llama-8b\|^decode" "$O/$m.log"
    save
  done
  ;;
pdl)
  # programmatic dependent launch (kernels/pdl.py): its GPU tests, the 32-layer FP8 chain
  # without and with it (bench/fp8_pdl_gpu.py), then the 8B decode step A B B A (A: --pdl off,
  # B: auto, the default; L*: all; E*: all with the products' early trigger)
  if [ "${T_TESTS:-150}" != 0 ]; then  # T_TESTS=0: the second call, runs only
    timeout "${T_TESTS:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_gemv_gpu.py tests/test_fp8_gpu.py -k "pdl or split or rows_match" \
      > "$O/pytest.log" 2>&1
    tail -2 "$O/pytest.log"
    timeout 200 python3 bench/fp8_pdl_gpu.py --rows 1,2,4,8,16,32,64 --out "$O/pdl.json" 2>&1 \
      | tee "$O/pdl.log" | cut -c1-200
    save
  fi
  for r in ${ORDER:-A1 B1 B2 A2}; do
    f="--pdl off"; e=late
    case $r in B*) f="--pdl auto";; L*) f="--pdl all";; E*) f="--pdl all"; e=early;; esac
    echo "== $r $(date +%T)"
    BUCKETSERVE_PDL_PRODUCTS=$e timeout "${T_RUN:-130}" python3 bench/gpu_8b.py --out "$O/$r" --modes fp8kv --requests "" \
      --batches 1,2,4,8,64 $f > "$O/$r.log" 2>&1
    grep -h "^decode" "$O/$r.log"
    save
  done
  ;;
accuracy)
  [ -f "$GGUF" ] || { echo "no $GGUF: carry .gpuparts/g0, g1, g2 in turn and run gguf_piece N"; exit 1; }
  timeout "${T_RUN:-500}" python3 bench/fp8_accuracy_gpu.py --out "$O" --model "$GGUF" \
    --fp8-fast-accum > "$O/accuracy.log" 2>&1
  grep -h '"config"' "$O/accuracy.log" | cut -c1-240
  ;;
served)
  # issue 28 must-show 3: vLLM's OpenAI server with --quantization fp8, then `bucketserve serve
  # --device cuda --quantization fp8` (no --api-workers: the default), the 8B shape, 1,024
  # streaming requests of gpu1024.jsonl, prefix caching off on both, closed loop, REPS runs
  # per concurrency (CS, default "64 256") after a 64-request warm-up. Needs vLLM's site in
  # $VLLM_SITE (bench/vllm_parts.sh, vllm_piece N in the calls before) and is about 8 minutes.
  [ -d "$VLLM_SITE/vllm" ] || { echo "served: no vLLM in $VLLM_SITE (bench/vllm_parts.sh)"; exit 1; }
  TOK=$TOK WORKLOAD=$R/.gpuassets/gpu1024.jsonl SHAPE=llama-8b CS="${CS:-64 256}" REPS=$REPEATS \
    API_WORKERS=auto SKIP_OFFLINE=1 OUT=$O VLLM_ARGS="--quantization fp8" \
    OURS_ARGS="--quantization fp8" LABEL_SUFFIX=_fp8 \
    timeout "${T_RUN:-570}" bash bench/online_gpu_vs_vllm.sh 2>&1 | tail -6
  save
  ;;
tuner)
  OUT=$O PARTS=tune ABBA=2 CLOSED_RUNS=${CLOSED_RUNS:-3} OUT_LEN=${OUT_LEN:-64} \
    TUNE_LIMIT=${T_RUN:-560} EMB_DIR=$R/.gpuassets/minilm bash bench/issue15_h200.sh
  ;;
*)
  echo "unknown part $PART"; exit 2 ;;
esac
save
done
