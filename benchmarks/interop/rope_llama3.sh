#!/usr/bin/env bash
# A llama3-RoPE model through GGUF and back: llama.cpp runs the GGUF (its rope_freqs tensor), transformers the
# Hugging Face directory qtool writes back from it (config.json rope_scaling). Never CI.
#   bash benchmarks/interop/rope_llama3.sh [WORK_DIR]   (from the repository root; record -> benchmarks/results/)
# HF_PY: transformers (qtool's venv with the optional extra is enough); LLAMA_PY: llama-cpp-python 0.3.36.
set -euo pipefail
W=${1:-/tmp/qtool-rope}
HF_PY=${HF_PY:-.venv/bin/python}
LLAMA_PY=${LLAMA_PY:-/work/envs/llama/bin/python}
QT=${QT:-.venv/bin/qtool}
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$W" && mkdir -p "$W"
step() { printf '\n$ %s\n' "$*" >&2; "$@"; }

step "$HF_PY" "$HERE/rope_side.py" make "$W/src"
step "$QT" pack "$W/src" -o "$W/g32" --to gptq --bits 8 --group-size 32 -q
step "$QT" repack "$W/g32" --to q8_0 -o "$W/m.gguf" -q
step "$QT" repack "$W/m.gguf" --to dense --dtype fp32 -o "$W/back" --json > "$W/back-plan.json"
step "$LLAMA_PY" "$HERE/rope_side.py" llama "$W/m.gguf" "$W/llama.json"
step "$HF_PY" "$HERE/rope_side.py" compare "$W" benchmarks/results/interop.json
