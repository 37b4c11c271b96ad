"""One compute dtype per engine: no program asks XLA:CPU for a bf16 x bf16 -> f32 dot.

CPUs with AMX / AVX-512 BF16 have no such dot in XLA:CPU's runtime ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32"); CPUs without them upcast silently. So the check reads the
programs, not the machine: the lowered StableHLO (what we ask for, the same on every CPU) and the
compiled HLO (what runs here).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import generate, load_draft, load_target, numerics
from dspark_jax.decode.config import EngineConfig
from dspark_jax.decode.engine import Engine

# `stablehlo.dot_general %a, %b, ... : (tensor<2x8x576xbf16>, tensor<576x49152xbf16>) -> tensor<...xf32>`
_STABLEHLO_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) "
                            r"-> tensor<[^>]*x(\w+)>")
# `%dot.3 = f32[2,8,64]{...} dot(bf16[2,8,32]{...} %a, bf16[64,32]{...} %b), ...`
_HLO_DOT = re.compile(r"= (\w+)\[[^\]]*\][^ ]* dot\((\w+)\[[^\]]*\][^ ]* [^,]+, (\w+)\[")


def mixed_dots(lowered) -> list[str]:
    """Dots with a 16-bit float operand and a float32 result, in the lowered and compiled text."""
    bad = []
    for line in lowered.as_text().splitlines():
        m = _STABLEHLO_DOT.search(line)
        if m and m.group(3) == "f32" and {"bf16", "f16"} & {m.group(1), m.group(2)}:
            bad.append(line.strip())
    for line in lowered.compile().as_text().splitlines():
        m = _HLO_DOT.search(line)
        if m and m.group(1) == "f32" and {"bf16", "f16"} & {m.group(2), m.group(3)}:
            bad.append(line.strip())
    return bad


def test_patterns_see_a_mixed_dot():
    """The checker itself: a bf16 x bf16 -> f32 dot is found (in the lowered text at least)."""
    a = jnp.ones((2, 8), jnp.bfloat16)
    lowered = jax.jit(lambda x, y: jnp.einsum("ij,kj->ik", x, y, preferred_element_type=jnp.float32)).lower(a, a)
    assert mixed_dots(lowered)
    same = jax.jit(lambda x, y: jnp.einsum("ij,kj->ik", x, y)).lower(a.astype(jnp.float32), a.astype(jnp.float32))
    assert not mixed_dots(same)


@pytest.fixture(scope="module")
def demo_pair(smollm2_dir):
    target = load_target(smollm2_dir, dtype=jnp.float32)
    draft = load_draft("smollm2-135m-dspark", dtype="checkpoint")   # as shipped: bf16
    assert draft.context_proj.weight.get_value().dtype == jnp.bfloat16
    return target, draft


def _programs(engine: Engine, batch: int = 2):
    caches = engine.new_caches(batch, 128)
    x0 = jnp.zeros((batch,), jnp.int32)
    lens = jnp.full((batch,), 20, jnp.int32)
    active = jnp.ones((batch,), bool)
    key = jax.random.PRNGKey(0)
    progs = {"step": engine.step_jit.lower(engine.t_state, engine.d_state, x0, None, lens, active, jnp.int32(128),
                                           caches, key)}
    if engine.draft is not None:
        progs["propose"] = engine.propose_jit.lower(engine.t_state, engine.d_state, x0, lens, caches, key)
    tokens = jnp.zeros((batch, 32), jnp.int32)
    progs["prefill"] = engine.prefill_jit.lower(engine.t_state, engine.d_state, tokens, lens, jnp.arange(batch),
                                                caches, key)
    return progs


@pytest.fixture(scope="module")
def shipped_generation(demo_pair):
    """Two prompts through generate() with the bf16 draft as shipped (the call that crashed on AMX
    CPUs), speculative (T = 7) and plain, each on an engine whose calls are spied on: every
    distinct program a run calls is lowered with that call's arguments and its mixed dots read.
    jit then runs what that `lower(...).compile()` built, so reading them costs no compilation.
    The scheduler never calls the draft's block pass alone (the step runs it inside): that
    program is lowered as well. Returns {T: (result, {program: mixed dots})}."""
    target, draft = demo_pair
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?",
               "What is 12 * 7?"]
    runs = {}
    for t in (7, 0):
        engine = Engine(target, draft if t else None, EngineConfig(num_speculative_tokens=t))
        programs = {}
        call = engine._call

        def spy(name, *args, tag=None, **kw):
            # one program per name, argument shapes and static settings (the weights are the same each call)
            key = (name, str(jax.tree.map(lambda x: getattr(x, "shape", x), (args[2:], kw))))
            if key not in programs:
                programs[key] = mixed_dots(engine.program(name, args, kw)[0].lower(*args, **kw))
            return call(name, *args, tag=tag, **kw)

        engine._call = spy
        try:
            # a dozen tokens take several verify steps; the programs, not the length, are what crashed
            result = generate(target, draft if t else None, prompts, max_new_tokens=12, num_speculative_tokens=t,
                              engine=engine)
        finally:
            del engine._call
        if t:
            programs[("propose",)] = mixed_dots(_programs(engine)["propose"])
        runs[t] = (result, programs)
    return runs


@pytest.mark.parametrize("t", [0, 7], ids=["decode", "verify"])
def test_no_bf16_to_f32_dot_with_the_shipped_draft(shipped_generation, t):
    _, programs = shipped_generation[t]
    assert {key[0] for key in programs} == ({"prefill", "propose", "step"} if t else {"prefill", "step"})
    for key, bad in programs.items():
        assert not bad, f"{key} (T={t}) asks for bf16 x bf16 -> f32 dots:\n" + "\n".join(bad[:5])


def test_the_engine_computes_the_draft_in_the_targets_dtype(demo_pair):
    target, draft = demo_pair
    engine = Engine(target, draft, EngineConfig(num_speculative_tokens=7))
    dtypes = {x.dtype for x in jax.tree.leaves(engine.d_state) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes == {jnp.dtype(jnp.float32)}


def test_batched_generation_with_the_shipped_draft(shipped_generation):
    """Two prompts with the bf16 draft as shipped (the call that crashed on AMX CPUs) equal plain decoding."""
    spec, plain = shipped_generation[7][0], shipped_generation[0][0]
    for s, p in zip(spec.outputs, plain.outputs):
        assert s.token_ids == p.token_ids
    assert spec.stats["num_verify_steps"] > 0


# a projection in the native form `numerics.native_bf16_gemm` probes: [M, I] x [O, I] -> [M, O], M >= 2
_NATIVE_FORM = re.compile(r": \(tensor<(\d+)x(\d+)xbf16>, tensor<(\d+)x(\d+)xbf16>\) -> tensor<(\d+)x(\d+)xf32>")


def _native_projection(line: str) -> bool:
    m = _NATIVE_FORM.search(line)
    if not m:
        return False
    rows, k, out, k2, rows2, out2 = (int(g) for g in m.groups())
    return k == k2 and rows == rows2 >= 2 and out == out2


def test_bf16_target_programs_have_no_mixed_dot():
    """A bf16 target (and draft) on CPU: the float32-accumulated products upcast their operands,
    except the projections the host's XLA:CPU runs natively (`numerics.native_bf16_gemm`): those are
    two-dimensional with at least two rows, the form the probe saw compiled into YNNPACK, and no
    mixed dot reaches the compiled program's top level (the thunk runtime)."""
    from flax import nnx

    from dspark_jax.decode.engine import cast_floating
    from tests.gen_utils import tiny_draft, tiny_llama

    target, draft = tiny_llama(), None
    draft = tiny_draft(target)
    for m in (target, draft):
        nnx.update(m, cast_floating(nnx.state(m), jnp.bfloat16))
    assert target.dtype == jnp.bfloat16
    engine = Engine(target, draft, EngineConfig(num_speculative_tokens=3))
    native = numerics.native_bf16_gemm()
    seen_native = 0
    for name, lowered in _programs(engine).items():
        bad = mixed_dots(lowered)
        if native:
            seen_native += sum(map(_native_projection, bad))
            bad = [line for line in bad if not _native_projection(line)]
        assert not bad, f"{name} asks for bf16 x bf16 -> f32 dots:\n" + "\n".join(bad[:5])
    assert (seen_native > 0) == native       # where the CPU can, the projections do use the native form
    np.testing.assert_equal(engine.compute_dtype, jnp.bfloat16)


def test_native_bf16_projection_is_the_float32_sum_rounded_once():
    """`numerics.linear` on bf16: where native, the float32 sum rounded once to bf16 (what torch's
    bf16 linear computes), one row (padded to two) equal to the same row inside a larger call;
    elsewhere the plain bf16 einsum. Either way the value is within one bf16 rounding of the float64 sum."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 576)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 576)) * 0.05, jnp.bfloat16)
    got = np.asarray(jax.jit(numerics.linear)(x, w), np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    ulp = np.abs(exact) * 2.0 ** -8 + 1e-30                      # bf16 has 8 significant bits
    assert np.all(np.abs(got - exact) <= ulp), np.max(np.abs(got - exact) / ulp)
    one = np.asarray(jax.jit(numerics.linear)(x[2:3], w), np.float64)       # a single row (padded)
    assert np.all(np.abs(one[0] - exact[2]) <= ulp[2])
    acc = np.asarray(jax.jit(numerics.linear_acc)(x, w))
    assert acc.dtype == np.float32
    np.testing.assert_allclose(acc, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    if not numerics.native_bf16_gemm():
        np.testing.assert_array_equal(got, np.asarray(jnp.einsum("mi,oi->mo", x, w), np.float64))


def test_native_bf16_gemm_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DSPARK_NATIVE_BF16_GEMM", "0")
    assert numerics.native_bf16_gemm.__wrapped__() is False


@pytest.mark.parametrize("family", ["llama", "k3"])
def test_bf16_engine_on_cpu_keeps_its_cache_as_bf16_bit_patterns_with_the_same_numbers(family):
    """A bf16 cache (kv_cache_dtype auto or bf16) on CPU stores uint16 bit patterns (XLA:CPU
    converts a whole bf16 pool around each scatter): after generating, the pages bitcast back are
    bf16 values equal to those of a float32 cache, and the output equals the run with a float32
    cache (which holds the same bf16 values exactly), speculative and plain."""
    from flax import nnx

    from dspark_jax.cache import as_values
    from dspark_jax.decode.config import SchedulerConfig
    from dspark_jax.decode.engine import cast_floating
    from dspark_jax.decode.scheduler import Request, Scheduler
    from tests.gen_utils import prompts, tiny_draft, tiny_k3, tiny_llama

    target = tiny_llama() if family == "llama" else tiny_k3()
    draft = tiny_draft(target) if family == "llama" else tiny_draft(target, layer_ids=(1, 3))
    for m in (target, draft):
        nnx.update(m, cast_floating(nnx.state(m), jnp.bfloat16))
    # bf16 resolves to auto's storage (the model's dtype), and an engine's programs see the cache
    # setting only through that storage dtype: auto's runs below stand for bf16's
    for kv in ("auto", "bf16"):
        engine = Engine(target, draft, EngineConfig(num_speculative_tokens=3, kv_cache_dtype=kv))
        assert engine.store_dtype == jnp.uint16
    # two prompts of one span bucket: the batch is not what is checked here
    ps = prompts(2, target.cfg.vocab_size, seed=2, hi=14)
    for d, t in ((draft, 3), (None, 0)):
        runs = {}
        for kv in ("auto", "fp32"):
            engine = Engine(target, d, EngineConfig(num_speculative_tokens=t, kv_cache_dtype=kv))
            assert engine.store_dtype == (jnp.float32 if kv == "fp32" else jnp.uint16)
            b = Scheduler(engine, SchedulerConfig(len(ps), 128))
            reqs = b.run([Request(p, 10) for p in ps])
            runs[kv] = ([r.tokens for r in reqs], np.asarray(as_values(b.caches.pool.pages).astype(jnp.float32)))
        assert np.count_nonzero(runs["auto"][1]) > 0
        np.testing.assert_array_equal(runs["auto"][1], runs["fp32"][1])
        assert runs["auto"][0] == runs["fp32"][0]
        assert all(len(tokens) == 10 for tokens in runs["auto"][0])


def test_entry_point_dtype_choice(smollm2_dir):
    """--dtype of serve.generate / serve.server / serve.bench: checkpoint, float32, bfloat16, or auto
    (bfloat16 exactly where the host CPU runs bf16 GEMMs natively); the draft follows the target."""
    from dspark_jax.serving.pair import load_pair, resolve_dtype
    assert resolve_dtype("checkpoint") is None and resolve_dtype(None) is None
    assert resolve_dtype("bfloat16") == jnp.bfloat16 and resolve_dtype("float32") == jnp.float32
    assert resolve_dtype("auto") == (jnp.dtype(jnp.bfloat16) if numerics.native_bf16_gemm() else None)
    with pytest.raises(ValueError, match="--dtype 'fp16'"):
        resolve_dtype("fp16")
    pair = load_pair(str(smollm2_dir), "smollm2-135m-dspark", dtype="bfloat16")
    assert pair.target.dtype == jnp.bfloat16
    assert pair.draft.context_proj.weight.get_value().dtype == jnp.bfloat16


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cpu_cache_writes_convert_no_whole_pool(kv_cache_dtype):
    """The compiled step of a bf16 engine on CPU (bf16 or fp8 cache) converts no array of the
    pool's shape: XLA:CPU runs a scatter into a narrow-float array on an f32 copy of all of it,
    which bit-pattern storage avoids (an fp8-typed pool shows such converts: no CPU has fp8
    arithmetic, so that control holds on any CPU)."""
    from flax import nnx

    from dspark_jax.decode.engine import cast_floating
    from tests.gen_utils import tiny_draft, tiny_llama

    target = tiny_llama()
    draft = tiny_draft(target)
    for m in (target, draft):
        nnx.update(m, cast_floating(nnx.state(m), jnp.bfloat16))
    engine = Engine(target, draft, EngineConfig(num_speculative_tokens=3, kv_cache_dtype=kv_cache_dtype))
    caches = engine.new_caches(2, 64)
    shape = ",".join(str(d) for d in caches.pool.pages.shape)
    x0, lens = jnp.ones((2,), jnp.int32), jnp.asarray([5, 7], jnp.int32)

    def converts(pool_caches):
        text = engine.step_jit.lower(engine.t_state, engine.d_state, x0, None, lens, jnp.ones((2,), bool),
                                     jnp.int32(64), pool_caches, jax.random.PRNGKey(0)).compile().as_text()
        return [ln for ln in text.splitlines() if f"[{shape}]" in ln and " convert(" in ln]

    assert converts(caches) == []
    # the check can fail: the same step over a float8-typed pool converts the whole pool
    typed = caches._replace(pool=caches.pool._replace(pages=jnp.zeros(caches.pool.pages.shape, jnp.float8_e4m3fn)))
    assert converts(typed) != []


def test_draft_pass_converts_no_whole_markov_table(monkeypatch):
    """A bf16 draft pass reads one Markov W1 row per drafted position. With the Markov head as a
    while loop, XLA:CPU handed the loop a converted copy of all of W1 ([V, r]) on every call;
    unrolled, the compiled step makes no array of W1's shape from it. Control: the rolled loop over
    an fp8 W1 (set after the engine's dtype cast) converts the whole table; no CPU has fp8
    arithmetic, so that control holds on any CPU."""
    from flax import nnx

    from dspark_jax import sampling
    from dspark_jax.decode.engine import cast_floating
    from tests.gen_utils import tiny_draft, tiny_llama

    def w1_copies(w1_dtype):
        target = tiny_llama()
        draft = tiny_draft(target)
        for m in (target, draft):
            nnx.update(m, cast_floating(nnx.state(m), jnp.bfloat16))
        engine = Engine(target, draft, EngineConfig(num_speculative_tokens=3))
        state = engine.d_state
        w1 = state["markov_head"]["markov_w1"]["weight"]
        w1.set_value(w1.get_value().astype(w1_dtype))
        engine.d_state = state
        text = engine.step_jit.lower(engine.t_state, engine.d_state, jnp.ones((1,), jnp.int32), None,
                                     jnp.asarray([5], jnp.int32), jnp.ones((1,), bool), jnp.int32(64),
                                     engine.new_caches(1, 64), jax.random.PRNGKey(0)).compile().as_text()
        v, r = w1.get_value().shape
        body = text[text.index("ENTRY"):].splitlines()[1:]
        # any whole-table array made from W1 (a converted copy, whatever its dtype)
        return [ln for ln in body if f"[{v},{r}]" in ln and "markov_w1" in ln and "parameter(" not in ln]

    assert w1_copies(jnp.bfloat16) == []
    assert w1_copies(jnp.float8_e4m3fn) == []
    monkeypatch.setattr(sampling, "_UNROLL_MARKOV", 1)
    assert w1_copies(jnp.float8_e4m3fn) != []
