#!/usr/bin/env bash
# vLLM 0.25.1 and its OpenAI server's dependencies for the GPU machine, in pieces small enough
# to carry one per device call beside the working tree (64 MiB a call in all).
#
#   bash bench/vllm_parts.sh            # here: downloads the wheels (PyPI), unpacks them into
#                                       # one site folder, xz-compresses it and splits it into
#                                       # .gpuparts/v0 .. vN (git-ignored), with its sha256
# then on the GPU machine, one call per piece, back to back (the machine and its /tmp go back
# after about 30 s idle), each with `carry: [".gpuparts/vN"]`:
#   source bench/gpu_setup.sh; vllm_piece N   # the last one joins, checks and unpacks them
#                                             # into $VLLM_SITE (/tmp/vsite/site)
# The wheel list is ../shared/bench/README.md's; numpy, torch and the rest of the image's
# own packages are not carried (the image's versions must win).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${VLLM_WHEELS:-/tmp/vllm-wheels}; PIECE_MB=${PIECE_MB:-38}
mkdir -p "$W"
pkgs="vllm==0.25.1 flashinfer-python==0.6.13 xgrammar==0.2.1 apache-tvm-ffi==0.1.9
compressed-tensors==0.17.0 depyf==0.20.0 diskcache==5.6.3 lark==1.2.2 outlines_core==0.2.14
annotated-types astor blake3 cachetools cbor2 dill fastapi gguf httpcore2 httpx2 jiter llguidance
msgspec openai openai-harmony opentelemetry-api partial-json-parser pybase64 pydantic
pydantic_core python-json-logger pyzmq setproctitle sniffio starlette truststore
typing-inspection uvicorn h11 anyio httpx httpcore sse-starlette prometheus-client
prometheus-fastapi-instrumentator python-multipart watchfiles model-hosting-container-standards
anthropic mcp mcp-types jsonschema jsonschema-specifications referencing rpds-py attrs ijson
lm-format-enforcer interegular mistral_common pycountry opentelemetry-sdk
opentelemetry-semantic-conventions opentelemetry-semantic-conventions-ai distro docstring-parser
httpx-sse pydantic-settings pydantic-extra-types python-dotenv pyjwt jmespath supervisor nvtx"
for p in $pkgs; do  # one at a time: each resolves to the newest wheel for the machine's Python
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$W" "$p"
done
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
mkdir -p "$T/site"
for w in "$W"/*.whl; do python3 -m zipfile -e "$w" "$T/site"; done  # what pip --target puts there
tar cf - -C "$T" site | xz -T0 -6 > "$T/site.tar.xz"
rm -rf .gpuparts/v*
split -b "${PIECE_MB}M" -d -a 1 "$T/site.tar.xz" "$T/p"
n=0
for p in "$T"/p?; do mkdir -p ".gpuparts/v$n"; mv "$p" ".gpuparts/v$n/piece"; n=$((n + 1)); done
sha256sum "$T/site.tar.xz" | cut -d' ' -f1 > ".gpuparts/v$((n - 1))/sha256"
echo "$n" > ".gpuparts/v$((n - 1))/count"
du -sh .gpuparts/v* | sed 's/^/  /'
echo "vLLM site: $n pieces (carry one per call with the working tree, $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes)"
