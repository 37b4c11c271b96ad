"""SmolLM2-135M (the embedded demo target) in our JAX model vs transformers on the same files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax import generate, load_target
from dspark_jax.tokenizer import load_tokenizer
from tests.float64 import TorchFloat64, assert_close, share_rope_table, x64

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
           "Explain in one paragraph why the sky is blue."]


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    return load_target(smollm2_dir, dtype=jnp.float32), load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def pair64(smollm2_dir):
    """Our target and transformers' in float64 (tests/float64.py), one float32 RoPE table."""
    from transformers import LlamaForCausalLM
    with x64():
        ours = load_target(smollm2_dir, dtype=jnp.float64)
    ref = LlamaForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float64).eval()
    share_rope_table(ref.model.rotary_emb, ours.model.layers[0].self_attn.rope)
    return ours, ref, load_tokenizer(smollm2_dir)


def _chat_ids(tok, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))


def test_logits_match_transformers(pair64):
    """30 layers, float64 on both sides: float64 reassociation only (measured 6e-15 relative)."""
    ours, ref, tok = pair64
    ids = _chat_ids(tok, PROMPTS[2])
    with torch.no_grad(), TorchFloat64():
        want = ref(torch.as_tensor([ids])).logits[0]
    with x64():
        got = np.asarray(jax.jit(lambda m, x: m.forward(x).logits)(ours, jnp.asarray([ids]))[0])
    assert_close(got, want, "SmolLM2 logits")


def test_greedy_continuations_match_transformers(pair64):
    """Our generation loop (prefill + cached decode) is transformers' greedy decoding, both in
    float64: one transformers forward over prompt + our tokens must pick, at every generated
    position, our next token as its argmax (teacher-forced greedy: the definition of a greedy
    continuation, without torch's slow float64 token-by-token loop). Exact token equality needs
    no near-ties: each step's top-2 margin must exceed 1e-8 x the logit scale (float64 error ~1e-13)."""
    ours, ref, tok = pair64
    with x64():
        res = generate(ours, None, PROMPTS, max_new_tokens=32, tokenizer=tok)
    for prompt, out in zip(PROMPTS, res.outputs):
        ids = _chat_ids(tok, prompt)
        n = len(out.token_ids)
        assert n == 32 or out.finish_reason == "stop"
        with torch.no_grad(), TorchFloat64():
            logits = ref(torch.as_tensor([ids + out.token_ids])).logits[0, len(ids) - 1:len(ids) - 1 + n]
        assert logits.argmax(-1).tolist() == out.token_ids, prompt
        top2 = torch.topk(logits, 2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-8 * float(logits.abs().max()), f"{prompt}: near-tie"


def test_capital_of_france(pair):
    ours, _ = pair
    res = generate(ours, None, ["What is the capital of France?"], max_new_tokens=16)
    assert "Paris" in res.outputs[0].text


def test_shipped_config_is_the_conversions(smollm2_dir):
    """dspark_jax/configs/smollm2-135m.json (what GPU step timings build a random target from)
    is the config the GGUF conversion writes."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "dspark_jax/configs/smollm2-135m.json"
    assert json.loads(shipped.read_text()) == json.loads((Path(smollm2_dir) / "config.json").read_text())
