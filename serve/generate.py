"""One-shot generation: `python -m serve.generate --model DIR --draft_model DIR --prompt "..."`.

Without model flags it runs the demo pair; while the distilled demo draft is not shipped yet it
decodes with the SmolLM2 target alone and says so.
"""

from __future__ import annotations

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "target directory or preset")
_DRAFT = flags.DEFINE_string("draft_model", None, "draft directory or preset (default: the demo draft "
                             "preset when available); 'none' for plain decoding")
_PROMPT = flags.DEFINE_string("prompt", "Explain in two sentences why the sky is blue.", "the prompt")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate at most", lower_bound=1)
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 = lossless speculative sampling", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus threshold in (0, 1]")
_T = flags.DEFINE_integer("num_speculative_tokens", 7, "drafts per verify step; 0 = plain", lower_bound=0)
_KV = flags.DEFINE_string("kv_cache_dtype", "auto", "paged cache storage: auto, fp32 or fp8")
_CHAT = flags.DEFINE_bool("chat", True, "render the prompt with the target's chat template")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")


def main(argv) -> None:
    del argv
    import json

    from dspark_jax import generate, load_draft, load_target

    target = load_target(_MODEL.value)
    draft = None
    name = _DRAFT.value
    if name is None:
        try:
            draft = load_draft("smollm2-135m-dspark")
        except NotImplementedError as e:
            print(f"[serve.generate] {e}; decoding without a draft", flush=True)
    elif name.lower() != "none":
        draft = load_draft(name)
    res = generate(target, draft, [_PROMPT.value], max_new_tokens=_NEW.value, temperature=_TEMP.value,
                   top_p=_TOP_P.value, num_speculative_tokens=_T.value if draft is not None else 0,
                   seed=_SEED.value, chat=_CHAT.value, kv_cache_dtype=_KV.value)
    out = res.outputs[0]
    print(out.text)
    print("[MTP Stats] " + json.dumps(out.stats))


if __name__ == "__main__":
    app.run(main)
