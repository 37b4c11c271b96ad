"""SmolLM2-135M (the embedded demo target) in our JAX model vs transformers on the same files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax import generate, load_target
from dspark_jax.tokenizer import load_tokenizer

PROMPTS = ["What is the capital of France?", "Write a short poem about autumn leaves.",
           "Explain in one paragraph why the sky is blue."]


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    from transformers import LlamaForCausalLM
    ours = load_target(smollm2_dir, dtype=jnp.float32)
    ref = LlamaForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    return ours, ref, load_tokenizer(smollm2_dir)


def test_logits_match_transformers(pair):
    ours, ref, tok = pair
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True)
    ids = tok.encode(text)
    with torch.no_grad():
        want = ref(torch.as_tensor([ids])).logits[0].numpy()
    got = np.asarray(jax.jit(lambda m, x: m.forward(x).logits)(ours, jnp.asarray([ids]))[0])
    # fp32 both sides over 30 layers; logits are O(10): einsum vs matmul summation order only
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    assert np.abs(got - want).max() < 1e-3


def test_greedy_continuations_match_transformers(pair):
    ours, ref, tok = pair
    res = generate(ours, None, PROMPTS, max_new_tokens=32, tokenizer=tok)
    for prompt, out in zip(PROMPTS, res.outputs):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
        with torch.no_grad():
            want = ref.generate(torch.as_tensor([ids]), max_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        n = len(out.token_ids)
        assert out.token_ids == want[:n], prompt
        assert n == 32 or out.finish_reason == "stop"


def test_capital_of_france(pair):
    ours, _, _ = pair
    res = generate(ours, None, ["What is the capital of France?"], max_new_tokens=16)
    assert "Paris" in res.outputs[0].text


def test_shipped_config_is_the_conversions(smollm2_dir):
    """dspark_jax/configs/smollm2-135m.json (what GPU step timings build a random target from)
    is the config the GGUF conversion writes."""
    import json
    from pathlib import Path

    shipped = Path(__file__).resolve().parent.parent / "dspark_jax/configs/smollm2-135m.json"
    assert json.loads(shipped.read_text()) == json.loads((Path(smollm2_dir) / "config.json").read_text())
