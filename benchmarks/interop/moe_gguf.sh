#!/usr/bin/env bash
# Mixture-of-experts models through GGUF: qtool's GPTQ pack of a tiny Qwen3-MoE, Qwen2-MoE and Mixtral, as Q8_0,
# run by llama.cpp against transformers on the same weights (the pack dequantized). Never CI.
#   bash benchmarks/interop/moe_gguf.sh [WORK_DIR]   (from the repository root; record -> benchmarks/results/)
# Environments: tiny_env.sh (HF_PY, LLAMA_PY).
set -euo pipefail
W=${1:-/tmp/qtool-moe}
source "$(dirname "$0")/tiny_env.sh"

for arch in qwen3moe qwen2moe mixtral; do
    step "$HF_PY" "$HERE/moe_side.py" make "$W/$arch" "$arch"
    step "$QT" pack "$W/$arch" -o "$W/$arch-g32" --to gptq --bits 8 --group-size 32 -q
    step "$QT" repack "$W/$arch-g32" --to q8_0 -o "$W/$arch.gguf" --json > "$W/$arch-gguf-plan.json"
    step "$QT" repack "$W/$arch-g32" --to dense --dtype fp32 -o "$W/$arch-dense" -q
    step "$LLAMA_PY" "$HERE/moe_side.py" llama "$W/$arch.gguf" "$W/$arch-llama.json"
    step "$HF_PY" "$HERE/moe_side.py" compare "$W/$arch-dense" "$W/$arch-llama.json" \
        benchmarks/results/interop.json "moe_$arch"
done
