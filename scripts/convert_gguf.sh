#!/usr/bin/env bash
# GGUFs of the demo target (SmolLM2-135M-Instruct) at BF16, F16 and Q8_0 for benchmarks.peers
# --llama_cpp_dir, made with llama.cpp's own convert_hf_to_gguf.py (from the sources that
# scripts/build_llama_cpp.sh unpacked) from the same converted HF safetensors our target loads.
#
#   scripts/convert_gguf.sh [LLAMA_CPP_DIR] [MODEL]     (defaults build/llama.cpp, smollm2-135m)
#
# Writes LLAMA_CPP_DIR/gguf/NAME-{bf16,f16,q8_0}.gguf, NAME the model directory's name (MODEL: a
# preset or a directory). Per output type the command is
#   python convert_hf_to_gguf.py MODEL_DIR --outtype bf16 --outfile LLAMA_CPP_DIR/gguf/NAME-bf16.gguf
# (Q8_0 is llama.cpp's 8-bit block format: other weights than ours, labelled so in every table.)
set -euo pipefail

LLAMA_CPP_DIR=${1:-build/llama.cpp}
MODEL=${2:-smollm2-135m}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
SRC=$(ls -d "$LLAMA_CPP_DIR"/src/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | tail -1)
if [[ -z "$SRC" || ! -f "$SRC/convert_hf_to_gguf.py" ]]; then
  echo "error: no convert_hf_to_gguf.py under $LLAMA_CPP_DIR/src: run scripts/build_llama_cpp.sh $LLAMA_CPP_DIR first" >&2
  exit 1
fi
# the converter imports sentencepiece even for a tokenizer.json-only model; installed beside the build
# (not into the environment) when the environment lacks it
DEPS=""
if ! "$PYTHON" -c "import sentencepiece" 2>/dev/null; then
  DEPS="$(cd "$LLAMA_CPP_DIR" && pwd)/pydeps"
  [[ -d "$DEPS/sentencepiece" ]] || "$PYTHON" -m pip install --quiet --target "$DEPS" sentencepiece
fi
MODEL_DIR=$("$PYTHON" -c "import sys; from dspark_jax.presets import resolve_model_path; print(resolve_model_path(sys.argv[1]))" "$MODEL")
mkdir -p "$LLAMA_CPP_DIR/gguf"
for t in bf16 f16 q8_0; do
  out="$LLAMA_CPP_DIR/gguf/$(basename "$MODEL_DIR")-$t.gguf"
  echo "$PYTHON $SRC/convert_hf_to_gguf.py $MODEL_DIR --outtype $t --outfile $out"
  # the converter's own gguf-py, which matches it, ahead of any installed gguf package
  PYTHONPATH="$SRC/gguf-py${DEPS:+:$DEPS}${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
    --outtype "$t" --outfile "$out"
done
ls -l "$LLAMA_CPP_DIR/gguf"
