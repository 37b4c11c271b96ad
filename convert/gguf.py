"""GGUF (llama.cpp, llama architecture) -> HF-layout safetensors + config + tokenizer.

    python -m convert.gguf --src FILE.gguf --dst DIR [--dtype bf16|f32]
"""

from __future__ import annotations

from absl import app, flags, logging

from dspark_jax.checkpoint.gguf import OUTPUT_DTYPES, GGUFError, convert_gguf

_SRC = flags.DEFINE_string("src", None, "GGUF file to read.", required=True)
_DST = flags.DEFINE_string("dst", None, "Output directory (must be absent or empty).", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "f32", sorted(OUTPUT_DTYPES), "Dtype of the written tensors.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    try:
        convert_gguf(_SRC.value, _DST.value, dtype=_DTYPE.value, progress=logging.info)
    except (GGUFError, FileExistsError) as e:
        logging.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    app.run(main)
