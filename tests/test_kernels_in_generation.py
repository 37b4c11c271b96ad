"""Generation with the Pallas kernels forced on (interpret mode on CPU) stays lossless."""

from __future__ import annotations

from dspark_jax.generate import generate
from dspark_jax.kernels.dispatch import use_kernels
from tests.gen_utils import prompts, tiny_draft, tiny_k3, tiny_llama


def _check(target, draft, n_prompts, new_tokens, t):
    # interpret mode runs every kernel program in Python: keep it short
    ps = prompts(n_prompts, target.cfg.vocab_size, seed=2, hi=12)
    plain = generate(target, None, ps, max_new_tokens=new_tokens)          # references
    with use_kernels("interpret"):
        spec = generate(target, draft, ps, max_new_tokens=new_tokens, num_speculative_tokens=t)
    for a, b in zip(plain.outputs, spec.outputs):
        assert a.token_ids == b.token_ids


def test_llama_pair_with_paged_mla_kernel():
    target = tiny_llama(0)
    _check(target, tiny_draft(target, 1), 2, 6, 3)


def test_k3_pair_with_kda_and_mla_kernels():
    target = tiny_k3(0)
    _check(target, tiny_draft(target, 1, layer_ids=(1, 3)), 1, 4, 2)
