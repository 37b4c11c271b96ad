"""The llama-family target on the checkpoints users bring: tiny random Llama 3 (llama3 rope, biases,
explicit head_dim), Qwen2 (q/k/v biases, YaRN, tied, `use_sliding_window: false`), Qwen3 (q/k
norms, head_dim, linear rope, sliding window from `max_window_layers`) and Mistral (sliding window
on every layer) models, written by transformers' `save_pretrained` and loaded from that HF layout.

Per family: float64 parity with transformers per layer and on the logits, float32 parity, the paged
cached steps equal the cacheless forward, and greedy speculative decoding with an untrained draft
gives the target's greedy continuation. Then the config keys refused by name and the eos ids."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dspark_jax import generate, load_target
from dspark_jax.cache import PagedPool, TargetCaches
from dspark_jax.checkpoint.loader import load_llama
from dspark_jax.config import load_config
from dspark_jax.config.keys import ConfigError
from dspark_jax.config.llama import LlamaConfig
from dspark_jax.decode import steps
from dspark_jax.decode.requests import eos_ids
from dspark_jax.models.llama import LlamaModel
from tests.float64 import TorchFloat64, assert_close, assert_f32_close, share_rope_table, x64
from tests.gen_utils import prompts, tiny_draft

VOCAB, HIDDEN, LAYERS, WINDOW = 64, 32, 3, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
              attn_implementation="eager")
# The scaled ropes act on a 16-position original context, so every rope type moves the tiny
# model's frequencies: llama3's three bands (head_dim 16, theta 1000: wavelengths 6.3 kept, 14.9
# blended, the rest divided), YaRN's ramp (low 1, high 3 of 4 pairs) and its cos/sin multiplier.
FAMILIES = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        head_dim=16, attention_bias=True, tie_word_embeddings=False, eos_token_id=[1, 2],
        rope_parameters=dict(rope_type="llama3", rope_theta=1000.0, factor=4.0, low_freq_factor=1.0,
                             high_freq_factor=2.0, original_max_position_embeddings=16))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=WINDOW, eos_token_id=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0,
                             original_max_position_embeddings=16))),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        head_dim=16, tie_word_embeddings=False, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        tie_word_embeddings=False, sliding_window=WINDOW, rope_theta=1000.0)),
}
# what each family must have switched on in our config, so a parity pass means the feature works
EXPECT = {
    "llama3": dict(qkv_bias=True, o_bias=True, qk_norm=False, head_dim=16, sliding_layers=()),
    "qwen2": dict(qkv_bias=True, o_bias=False, qk_norm=False, head_dim=8, sliding_layers=()),
    "qwen3": dict(qkv_bias=False, o_bias=False, qk_norm=True, head_dim=16, sliding_layers=(1, 2)),
    "mistral": dict(qkv_bias=False, o_bias=False, qk_norm=False, head_dim=8, sliding_layers=(0, 1, 2)),
}


def _save(family: str, directory) -> torch.nn.Module:
    """A random model of `family` saved by `save_pretrained`. HF's init (std 0.02, unit norms, zero
    biases) makes attention nearly uniform and norms no-ops; larger weights make rope, windows,
    GQA grouping, biases and norm weights visible in the outputs."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = model_cls(cfg_cls(**COMMON, **copy.deepcopy(extra))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, _save(request.param, d), d


def _layer_outputs(hf_model, run):
    """Each decoder layer's output while `run()` runs the reference."""
    outs, hooks = [], [layer.register_forward_hook(lambda mod, args, out: outs.append(
        out[0] if isinstance(out, tuple) else out)) for layer in hf_model.model.layers]
    try:
        ref = run()
    finally:
        for h in hooks:
            h.remove()
    return ref, outs


def _check_against(ours, ref, layer_outs, check):
    aux = np.asarray(ours.aux_hidden).reshape(*ref.logits.shape[:2], LAYERS, HIDDEN)
    for l in range(LAYERS):
        check(aux[:, :, l], layer_outs[l].detach().numpy(), f"layer {l}")
    check(np.asarray(ours.final_hidden), ref.hidden_states[-1].detach().numpy(), "final hidden")
    check(np.asarray(ours.logits), ref.logits.detach().numpy(), "logits")


def _forward(model, tokens):
    return nnx.jit(lambda m, t: m.forward(t, tuple(range(LAYERS))))(model, jnp.asarray(tokens))


def test_config_reads_the_family(family):
    name, hf_model, d = family
    cfg = LlamaConfig.from_json(d / "config.json")
    assert {k: getattr(cfg, k) for k in EXPECT[name]} == EXPECT[name]
    assert cfg.sliding_window == (WINDOW if EXPECT[name]["sliding_layers"] else None)
    assert cfg.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert cfg.rope.rope_type == {"llama3": "llama3", "qwen2": "yarn", "qwen3": "linear", "mistral": "default"}[name]


def test_float64_matches_transformers(family):
    """Float64 on both sides (tests/float64.py), one float32 rope table after checking ours equals
    transformers' scaled table to 4 ulps: every layer, the final hidden state and the logits."""
    name, hf_model, d = family
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 12))    # 12 > WINDOW
    with x64():
        model = load_target(d, dtype=jnp.float64)
        ref64 = copy.deepcopy(hf_model).double()
        rope = model.model.layers[0].self_attn.rope
        assert rope.attention_factor == pytest.approx(ref64.model.rotary_emb.attention_scaling, rel=1e-12)
        share_rope_table(ref64.model.rotary_emb, rope)
        with torch.no_grad(), TorchFloat64():
            ref, outs = _layer_outputs(ref64, lambda: ref64(torch.as_tensor(tokens), output_hidden_states=True))
        _check_against(_forward(model, tokens), ref, outs, assert_close)


def test_float32_matches_transformers(family):
    """Float32 on both sides: the two programs differ in summation order only (F32_RTOL)."""
    name, hf_model, d = family
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
    model = load_target(d, dtype=jnp.float32)
    with torch.no_grad():
        ref, outs = _layer_outputs(hf_model, lambda: hf_model(torch.as_tensor(tokens), output_hidden_states=True))
    _check_against(_forward(model, tokens), ref, outs, assert_f32_close)


def test_cached_steps_match_cacheless(family):
    """Through the paged pool (page size 4) with the serving layout's fused weights (and biases):
    a ragged prefill, token-by-token decode and a 3-token verify step past the window; every real
    token's logits and aux rows equal the cacheless forward's."""
    name, _, d = family
    model = load_target(d, dtype=jnp.float32)
    rng = np.random.default_rng(2)
    lengths, n_decode = (6, 3), 3
    full = rng.integers(0, VOCAB, (2, max(lengths) + n_decode + 3))   # row 1 stops 3 short of its end
    aux_ids = tuple(range(LAYERS))
    weights = model.serving_weights()
    step = nnx.jit(lambda m, t, p, v, c, w: steps.target_forward(m, t, p, v, c, aux_ids, verify=False,
                                                                  weights=w)[:2])
    got = [dict() for _ in lengths]

    def run(tokens_BT, positions_BT, valid_BT, caches):
        out, caches = step(model, jnp.asarray(tokens_BT), jnp.asarray(positions_BT), jnp.asarray(valid_BT),
                           caches, weights)
        for b in range(len(lengths)):
            for t, p in enumerate(positions_BT[b]):
                if valid_BT[b, t]:
                    got[b][int(p)] = (np.asarray(out.logits[b, t]), np.asarray(out.aux_hidden[b, t]))
        return caches

    cfg = model.cfg
    caches = TargetCaches(PagedPool.create(LAYERS, 2, 16, 4, 2 * cfg.num_key_value_heads * cfg.head_dim,
                                           jnp.float32), None)
    t0 = max(lengths)
    pos = np.tile(np.arange(t0), (2, 1))
    valid = pos < np.array(lengths)[:, None]
    tok = np.where(valid, np.stack([f[:t0] for f in full]), 0)
    caches = run(tok, pos, valid, caches)
    for i in range(n_decode):
        caches = run(np.array([[full[b][n + i]] for b, n in enumerate(lengths)]),
                     np.array([[n + i] for n in lengths]), np.ones((2, 1), bool), caches)
    cur = [n + n_decode for n in lengths]
    run(np.stack([full[b][c:c + 3] for b, c in enumerate(cur)]),
        np.stack([np.arange(c, c + 3) for c in cur]), np.ones((2, 3), bool), caches)
    ref = _forward(model, full)         # causal: a row's later tokens do not change its earlier rows
    for b, n in enumerate(lengths):
        assert sorted(got[b]) == list(range(n + n_decode + 3))
        for p, (logits, aux) in got[b].items():
            assert_f32_close(logits, ref.logits[b, p], f"row {b} pos {p} logits")
            assert_f32_close(aux, ref.aux_hidden[b, p], f"row {b} pos {p} aux")


def test_speculative_decoding_is_lossless(family):
    """An untrained draft, every step verifying all 4 drafts: the tokens are the target's greedy
    continuation, i.e. at every generated position the argmax of one cacheless forward over prompt
    + output (teacher-forced greedy, the definition of plain greedy decoding, without compiling a
    second engine). Exact equality needs no near-ties: each top-2 margin must exceed 1e-3 of the
    logit scale, far above float32's summation-order noise (~1e-6)."""
    name, _, d = family
    target = load_llama(d)      # not `load_target`: that one registers the directory for its tokenizer
    assert isinstance(target, LlamaModel)
    draft = tiny_draft(target, seed=5, layer_ids=(0, LAYERS - 1))
    ps = prompts(4, VOCAB, seed=3, hi=12)
    new = 12                    # past the window
    spec = generate(target, draft, ps, max_new_tokens=new, num_speculative_tokens=4, speculative_length="fixed")
    assert spec.stats["total_accepted_tokens"] > 0, "no draft accepted: the verify path went untested"
    rows = [p + o.token_ids for p, o in zip(ps, spec.outputs)]
    assert all(len(o.token_ids) == new for o in spec.outputs)
    width = max(len(r) for r in rows)
    logits = np.asarray(_forward(target, np.array([r + [0] * (width - len(r)) for r in rows])).logits)
    for i, (p, r) in enumerate(zip(ps, rows)):
        step_logits = logits[i, len(p) - 1:len(r) - 1]
        assert step_logits.argmax(-1).tolist() == r[len(p):], f"prompt {i}: not the greedy continuation"
        top2 = np.sort(step_logits, -1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 1e-3 * np.abs(step_logits).max(), f"prompt {i}: near-tie"


# ------------------------------------------------------------------------------------------
# config keys: what is refused names the key; eos ids


BASE = dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)


@pytest.mark.parametrize("edit, match", [
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), r"rope_scaling\.rope_type: 'dynamic' is not supported"),
    (dict(rope_parameters=dict(rope_type="longrope", short_factor=[1.0])), r"rope_parameters\.rope_type: 'longrope'"),
    (dict(rope_scaling=dict(type="linear")), r"rope_scaling\.factor: required"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), r"rope_scaling: missing required key 'low_freq_factor'"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0, truncate=False)), r"rope_scaling\.truncate"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="default"))), r"rope_parameters: per-layer-type"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor: 0\.5"),
    (dict(mlp_bias=True), r"mlp_bias: MLP biases are not supported"),
    (dict(model_type="mistral", sliding_window=0), r"sliding_window: 0 must be a positive integer"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
     r"layer_types: 1 entries for num_hidden_layers=3"),
    (dict(model_type="qwen2", layer_types=["full_attention", "chunked_attention", "full_attention"]),
     r"layer_types: unknown layer types \['chunked_attention'\]"),
    (dict(model_type="gemma"), r"model_type: expected a llama-family model"),
])
def test_refused_config_keys_are_named(edit, match):
    with pytest.raises(ConfigError, match=match):
        LlamaConfig.from_dict(dict(BASE, **edit), "x/config.json")


def test_config_variants():
    """Old `rope_scaling` with `type`, YaRN's factor from the context ratio, Qwen2's sliding layers
    from max_window_layers or layer_types, and a Qwen2 config with the window switched off."""
    cfg = LlamaConfig.from_dict(dict(BASE, rope_theta=5e5, rope_scaling=dict(type="linear", factor=2.0)))
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope_theta) == ("linear", 2.0, 5e5)
    cfg = LlamaConfig.from_dict(dict(BASE, rope_scaling=dict(rope_type="yarn", original_max_position_embeddings=16)))
    assert cfg.rope.factor == 4.0 and cfg.rope.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    qwen = dict(BASE, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert LlamaConfig.from_dict(qwen).sliding_layers == (2,)
    typed = dict(qwen, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert LlamaConfig.from_dict(typed).sliding_layers == (0, 2)
    off = LlamaConfig.from_dict(dict(qwen, use_sliding_window=False))
    assert (off.sliding_window, off.sliding_layers, off.window(2)) == (None, (), None)


def test_every_eos_id_ends_generation(tmp_path):
    """A list-valued eos_token_id and generation_config.json's ids are all kept (Llama 3 instruct
    ends turns with <|eot_id|>, listed only in generation_config.json), and generation stops at each."""
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, eos_token_id=[5, 7])))
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=[7, 9])))
    cfg = LlamaConfig.from_json(tmp_path / "config.json")
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (5, (5, 7, 9))
    assert load_config(tmp_path).eos_token_ids == (5, 7, 9)
    assert eos_ids(SimpleNamespace(cfg=cfg), None) == {5, 7, 9}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id"):
        LlamaConfig.from_json(tmp_path / "config.json")


# ------------------------------------------------------------------------------------------
# chat templates from tokenizer_config.json

# Written for this test in the shapes of the families' own templates: Llama 3.x (bos, header
# markers, a system prompt dated with strftime_now, <|eot_id|>) and Qwen (ChatML, tools as JSON, a
# `{% generation %}` block, loop controls).
LLAMA3_STYLE = (
    "{{ bos_token }}{% set date = strftime_now('%Y') %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday: {{ date }}\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}{% endif %}<|eot_id|>"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson(sort_keys=True) }}\n{% endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
CHAT = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "tool", "content": "x"},
        {"role": "user", "content": "and?"}]


@pytest.mark.parametrize("template", [LLAMA3_STYLE, QWEN_STYLE], ids=["llama3", "qwen"])
def test_chat_template_from_tokenizer_config_matches_transformers(tmp_path, template):
    import tokenizers

    from dspark_jax.tokenizer import load_tokenizer
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|im_start|>", "<|im_end|>"]
    words = ["system", "user", "assistant", "hi", "hello", "and?", "Be", "brief.", "[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                         eos_token="<|eot_id|>").save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path.write_text(json.dumps(dict(json.loads(cfg_path.read_text()), chat_template=template)))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    tools = [{"name": "get_time", "parameters": {"type": "object"}}]
    for kw in (dict(add_generation_prompt=True), dict(add_generation_prompt=False, tools=tools)):
        want = hf.apply_chat_template(CHAT, tokenize=False, **kw)
        assert ours.apply_chat_template(CHAT, **kw) == want
        assert ours.encode(want) == hf(want, add_special_tokens=False)["input_ids"]
