# Sourced on the GPU machine, from the repository root, with .gpuassets carried
# (bench/gpu_assets.sh builds it): installs the wheels the image lacks into /tmp/site once per
# machine and exports what the GPU benchmarks and tests read.
#
#   source bench/gpu_setup.sh && machine > $OUT/machine.txt
if [ ! -d .gpuassets/wheels-ours ]; then
  echo "gpu_setup: no .gpuassets carried: the wheels are not installed (enough for vllm_piece)"
elif [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpuassets/wheels-ours/*.whl && touch /tmp/site/.done \
    || { echo "gpu_setup: installing the wheels failed"; return 1; }
fi
export R=$PWD
export PYTHONPATH=/tmp/site:$R HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TOK=$R/.gpuassets/smollm2-tok SMOLLM2_TOKENIZER_DIR=$R/.gpuassets/smollm2-tok
export OLD=$R/.gpuassets/old  # the package at .gpuassets/old/REV, for A/B runs
machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | sed -n 's/^Model name: *//p'; nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git -C "$R" log -1 --format='tree at %h %s' 2>/dev/null || true
  cat "$OLD/REV" 2>/dev/null | sed 's/^/old: /'
}
# python -m puts the working directory ahead of PYTHONPATH: servers of an A/B must start from
# another directory (cd /tmp) so that each imports the package its PYTHONPATH names
which_package() { (cd /tmp && PYTHONPATH=$1:/tmp/site python3 -c 'import bucketserve; print(bucketserve.__file__)'); }
# the GGUF in pieces (gpu_assets.sh GGUF_PARTS=1): one call per piece, back to back, each with
# `carry: [".gpuassets", ".gpuparts/gN"]`; `gguf_piece N` keeps piece N in /tmp/gguf and,
# once all three are there, joins them into $GGUF and checks the sum
export GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
gguf_piece() {
  mkdir -p /tmp/gguf && cp "$R/.gpuparts/g$1/piece" /tmp/gguf/p$1
  [ -f "$R/.gpuparts/g$1/sha256" ] && cp "$R/.gpuparts/g$1/sha256" /tmp/gguf/sha256
  if [ -f /tmp/gguf/p0 ] && [ -f /tmp/gguf/p1 ] && [ -f /tmp/gguf/p2 ] && [ -f /tmp/gguf/sha256 ]; then
    cat /tmp/gguf/p0 /tmp/gguf/p1 /tmp/gguf/p2 > "$GGUF"
    [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$(cat /tmp/gguf/sha256)" ] && echo "gguf: joined" \
      || { echo "gguf: checksum differs"; rm -f "$GGUF"; return 1; }
  else
    echo "gguf: pieces so far: $(ls /tmp/gguf | tr '\n' ' ')"
  fi
}
# vLLM's site in pieces (bench/vllm_parts.sh): one call per piece, back to back, each with
# `carry: [".gpuparts/vN"]`; `vllm_piece N` keeps piece N in /tmp/vparts and, once all are
# there (the last carries their count and sum), joins and unpacks them into $VLLM_SITE
export VLLM_SITE=/tmp/vsite/site
vllm_piece() {
  mkdir -p /tmp/vparts && cp "$R/.gpuparts/v$1/piece" /tmp/vparts/p$1
  for f in sha256 count; do
    [ -f "$R/.gpuparts/v$1/$f" ] && cp "$R/.gpuparts/v$1/$f" /tmp/vparts/$f
  done
  [ -f /tmp/vparts/count ] || { echo "vllm: pieces so far: $(ls /tmp/vparts | tr '\n' ' ')"; return 0; }
  local n i parts=()
  n=$(cat /tmp/vparts/count)
  for ((i = 0; i < n; i++)); do
    [ -f /tmp/vparts/p$i ] || { echo "vllm: piece $i missing"; return 0; }
    parts+=(/tmp/vparts/p$i)
  done
  [ "$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)" = "$(cat /tmp/vparts/sha256)" ] \
    || { echo "vllm: checksum differs"; return 1; }
  rm -rf /tmp/vsite && mkdir -p /tmp/vsite && cat "${parts[@]}" | xz -d | tar x -C /tmp/vsite \
    && echo "vllm: unpacked into $VLLM_SITE ($(du -sh /tmp/vsite | cut -f1))"
}
