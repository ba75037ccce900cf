# Sourced by the tiny-model interop scripts (rope_llama3.sh, moe_gguf.sh) after they set W: the environments
# (HF_PY: transformers, qtool's venv with the optional extra is enough; LLAMA_PY: llama-cpp-python 0.3.36),
# qtool's CLI, a fresh work directory, and `step`, which echoes each command before running it.
HF_PY=${HF_PY:-.venv/bin/python}
LLAMA_PY=${LLAMA_PY:-/work/envs/llama/bin/python}
QT=${QT:-.venv/bin/qtool}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rm -rf "$W" && mkdir -p "$W"
step() { printf '\n$ %s\n' "$*" >&2; "$@"; }
