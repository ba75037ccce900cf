#!/usr/bin/env bash
# A llama3-RoPE model through GGUF and back: llama.cpp runs the GGUF (its rope_freqs tensor), transformers the
# Hugging Face directory qtool writes back from it (config.json rope_scaling). Never CI.
#   bash benchmarks/interop/rope_llama3.sh [WORK_DIR]   (from the repository root; record -> benchmarks/results/)
# Environments: tiny_env.sh (HF_PY, LLAMA_PY).
set -euo pipefail
W=${1:-/tmp/qtool-rope}
source "$(dirname "$0")/tiny_env.sh"

step "$HF_PY" "$HERE/rope_side.py" make "$W/src"
step "$QT" pack "$W/src" -o "$W/g32" --to gptq --bits 8 --group-size 32 -q
step "$QT" repack "$W/g32" --to q8_0 -o "$W/m.gguf" -q
step "$QT" repack "$W/m.gguf" --to dense --dtype fp32 -o "$W/back" --json > "$W/back-plan.json"
step "$LLAMA_PY" "$HERE/rope_side.py" llama "$W/m.gguf" "$W/llama.json"
step "$HF_PY" "$HERE/rope_side.py" compare "$W" benchmarks/results/interop.json
