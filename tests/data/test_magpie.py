"""Magpie query sampling: the template prefix, the request filter, resume, archive and pool."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
from types import SimpleNamespace
from typing import ClassVar

import pytest

from dspark_jax.data import magpie, prompts
from dspark_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def test_query_prefix_is_the_template_up_to_the_user_turn(tokenizer):
    prefix = magpie.query_prefix(tokenizer)
    assert prefix.endswith("<|im_start|>user\n")
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=False)
    assert full.startswith(prefix + "Hi there")
    assert "Hi there" not in prefix


def test_query_prefix_refuses_a_template_that_rewrites_the_message():
    class Lowering:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "<s>" + "".join(m["content"].lower() for m in messages)

    with pytest.raises(ValueError, match="verbatim"):
        magpie.query_prefix(Lowering())


@pytest.mark.parametrize("text, reason, kept", [
    ("  How do I bake sourdough bread at home?\n", "stop", "How do I bake sourdough bread at home?"),
    ("How do I bake sourdough bread at home and", "length", None),      # cut at the token limit
    ("Hi?", "stop", None),                                               # too short
    ("1234567890 + 1234567890 = ?", "stop", None),                       # no letters
    ("Tell me a story<|im_start|>assistant\nOnce", "stop", None),         # template markup
])
def test_clean_query(text, reason, kept):
    assert magpie.clean_query(text, reason) == kept


class _FakeScheduler:
    """Stands in for the decoding loop: request i of a scheduler seeded s 'writes' a question made
    of two hashes of (s, i); every third one runs to the token limit. Records the seeds it was built with."""

    seeds: ClassVar[list[int]] = []
    never_stops = False

    def __init__(self, engine, config, *, seed=0):
        type(self).seeds.append(seed)
        self.seed, self.queue = seed, []

    def add(self, req):
        self.queue.append(req)

    def has_work(self):
        return bool(self.queue)

    # one request per step, none left running in between: everything queued is waiting
    num_running = 0

    @property
    def waiting(self):
        return list(self.queue)

    @property
    def num_waiting(self):
        return len(self.queue)

    def abort(self, req):
        self.queue.remove(req)
        req.finish_reason = "abort"

    def step(self):
        if not self.queue:
            return []
        req = self.queue.pop(0)
        if self.never_stops or req.index % 3 == 2:
            req.tokens, req.finish_reason = [42] * req.max_new_tokens, "length"
        else:
            a, b = (hashlib.sha256(f"{self.seed}-{req.index}-{k}".encode()).hexdigest()[:12] for k in (0, 1))
            req.tokens = self.tok.encode(f"What does {a} mean for {b}?") + [2]
            req.finish_reason = "stop"
        return [req]


@pytest.fixture
def fake_decoding(monkeypatch, tokenizer):
    cls = type("Fake", (_FakeScheduler,), {"seeds": [], "never_stops": False, "tok": tokenizer})
    monkeypatch.setattr(magpie, "Scheduler", cls)
    monkeypatch.setattr(magpie, "engine_for", lambda *a, **k: None)
    return cls


def _settings(tokenizer, **kw):
    base = {"target": "fake", "temperature": 1.0, "top_p": 0.99, "max_new_tokens": 8, "seed": 3,
            "prefix_sha256": magpie.prefix_sha256(tokenizer)}
    return magpie.MagpieSettings(**{**base, **kw})


TARGET = SimpleNamespace(cfg=SimpleNamespace(eos_token_id=2, eos_token_ids=(2,)))


def test_sample_queries_resumes_without_repeating(tmp_path, tokenizer, fake_decoding):
    cache = tmp_path / "q.jsonl"
    s = _settings(tokenizer)
    c1 = magpie.sample_queries(TARGET, tokenizer, cache, num_queries=5, settings=s, batch_size=2)
    rows = magpie.read_cache(cache)
    assert c1["accepted"] == 5 and len(magpie.queries(cache)) == 5
    assert any(r["query"] is None and r["finish_reason"] == "length" for r in rows)
    assert [r["id"] for r in rows] == [f"magpie/3-{i:06d}" for i in range(len(rows))]

    with open(cache, "a") as f:                       # a kill mid-line
        f.write('{"id": "magpie/3-0000')
    c2 = magpie.sample_queries(TARGET, tokenizer, cache, num_queries=9, settings=s, batch_size=2)
    assert c2["accepted_before"] == 5 and c2["accepted"] == 4
    rows = magpie.read_cache(cache)
    assert [r["id"] for r in rows] == [f"magpie/3-{i:06d}" for i in range(len(rows))]
    texts = [q for _, q in magpie.queries(cache)]
    assert len(set(texts)) == len(texts) == 9          # the resumed round did not replay the first
    assert fake_decoding.seeds[0] == 3 * 1_000_003 and len(set(fake_decoding.seeds)) == len(fake_decoding.seeds)
    assert magpie.sample_queries(TARGET, tokenizer, cache, num_queries=9, settings=s)["sampled"] == 0


def test_steered_requests_open_with_the_openers_in_turn(tmp_path, tokenizer, fake_decoding):
    prompts_seen = []
    add = fake_decoding.add
    fake_decoding.add = lambda self, req: (prompts_seen.append(tokenizer.decode(req.prompt)), add(self, req))
    cache = tmp_path / "q.jsonl"
    s = _settings(tokenizer, openers="Write,Pretend you are")
    magpie.sample_queries(TARGET, tokenizer, cache, num_queries=4, settings=s, batch_size=2)
    prefix = magpie.query_prefix(tokenizer)
    assert prompts_seen[:2] == [prefix + "Write", prefix + "Pretend you are"]
    rows = magpie.read_cache(cache)
    assert [r["id"] for r in rows] == [f"magpie-open/3-{i:06d}" for i in range(len(rows))]
    kept = [q for _, q in magpie.queries(cache)]
    assert kept[0].startswith("WriteWhat does ") and kept[1].startswith("Pretend you areWhat does ")
    # an unsteered cache's settings were written before `openers` existed: still resumable
    plain = tmp_path / "plain.jsonl"
    magpie.sample_queries(TARGET, tokenizer, plain, num_queries=2, settings=_settings(tokenizer))
    meta = json.loads(magpie.meta_path(plain).read_text())
    del meta["openers"]
    magpie.meta_path(plain).write_text(json.dumps(meta))
    resumed = magpie.sample_queries(TARGET, tokenizer, plain, num_queries=3, settings=_settings(tokenizer))
    assert resumed["accepted"] == 1
    with pytest.raises(ValueError, match="openers"):
        magpie.sample_queries(TARGET, tokenizer, plain, num_queries=4, settings=s)
    with pytest.raises(ValueError, match="empty opener"):
        magpie.openers(_settings(tokenizer, openers="Write,,Imagine"))


def test_time_budget_stops_sampling_and_a_rerun_resumes(tmp_path, tokenizer, fake_decoding, monkeypatch):
    clock = itertools.count()                           # every reading of the clock is one second later
    monkeypatch.setattr(magpie, "time", SimpleNamespace(time=lambda: float(next(clock))))
    cache = tmp_path / "q.jsonl"
    s = _settings(tokenizer)
    assert magpie.sample_queries(TARGET, tokenizer, cache, num_queries=6, settings=s, deadline=0.0)["sampled"] == 0
    stopped = magpie.sample_queries(TARGET, tokenizer, cache, num_queries=6, settings=s, deadline=next(clock) + 4)
    rows = magpie.read_cache(cache)
    assert 0 < stopped["sampled"] == len(rows) and stopped["accepted"] < 6
    resumed = magpie.sample_queries(TARGET, tokenizer, cache, num_queries=6, settings=s)
    assert resumed["accepted_before"] == stopped["accepted"] and resumed["accepted"] == 6 - stopped["accepted"]
    rows = magpie.read_cache(cache)
    assert [r["id"] for r in rows] == [f"magpie/3-{i:06d}" for i in range(len(rows))]
    texts = [q for _, q in magpie.queries(cache)]
    assert len(set(texts)) == len(texts) == 6


def test_sample_queries_refuses_other_settings(tmp_path, tokenizer, fake_decoding):
    cache = tmp_path / "q.jsonl"
    magpie.sample_queries(TARGET, tokenizer, cache, num_queries=2, settings=_settings(tokenizer))
    with pytest.raises(ValueError, match="temperature"):
        magpie.sample_queries(TARGET, tokenizer, cache, num_queries=4, settings=_settings(tokenizer, temperature=0.7))


def test_sample_queries_gives_up_on_a_model_that_never_ends_the_turn(tmp_path, tokenizer, fake_decoding):
    fake_decoding.never_stops = True
    cache = tmp_path / "q.jsonl"
    with pytest.raises(RuntimeError, match="0 of 20 samples"):
        magpie.sample_queries(TARGET, tokenizer, cache, num_queries=2, settings=_settings(tokenizer))
    assert len(magpie.read_cache(cache)) == 20          # what was sampled is kept


def test_archive_round_trip_and_refusals(tmp_path, tokenizer, fake_decoding):
    cache, archive = tmp_path / "q.jsonl", tmp_path / "a" / "q.jsonl.gz"
    magpie.sample_queries(TARGET, tokenizer, cache, num_queries=4, settings=_settings(tokenizer),
                          on_write=lambda: magpie.write_archive(cache, archive))
    n = len(magpie.read_cache(cache))
    assert magpie.restore_archive(archive, tmp_path / "from_on_write.jsonl") == n   # written at the end
    first = archive.read_bytes()
    assert magpie.write_archive(cache, archive) == n and archive.read_bytes() == first   # reproducible

    fresh = tmp_path / "fresh" / "q.jsonl"            # its directory does not exist yet
    assert magpie.restore_archive(archive, fresh) == n
    assert fresh.read_text() == cache.read_text()
    assert magpie.meta_path(fresh).read_text() == magpie.meta_path(cache).read_text()
    assert magpie.restore_archive(archive, fresh) == 0

    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "magpie/9-000000", "text": "x", "query": None}) + "\n")
    with pytest.raises(ValueError, match="not a prefix"):
        magpie.restore_archive(archive, other)
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as g:
        g.write(json.dumps({"id": "x"}) + "\n")
    with pytest.raises(ValueError, match="not a query archive"):
        magpie.restore_archive(bad, tmp_path / "none.jsonl")


def test_magpie_source_goes_through_the_pool_filters(tmp_path, tokenizer, fake_decoding):
    cache = tmp_path / "q.jsonl"
    magpie.sample_queries(TARGET, tokenizer, cache, num_queries=6, settings=_settings(tokenizer))
    rows = prompts.load_sources(["magpie"], magpie_cache=cache)["magpie"]
    assert [(r.id, r.text) for r in rows] == magpie.queries(cache)
    assert {r.source for r in rows} == {"magpie"}
    # a request that quotes a benchmark question is dropped like any other contaminated prompt
    bench = "Compose an engaging travel blog post about a recent trip to Hawaii highlighting cultural experiences"
    rows.append(prompts.PromptRow("magpie/3-999999", "magpie", "Please: " + bench + " and more."))
    result = prompts.build_pool({"magpie": rows}, {"mt_bench": [bench]})
    assert result.removed["contaminated:mt_bench"] == {"magpie": 1}
    assert len(result.records) == 6 and all(r["source"] == "magpie" for r in result.records)

    with pytest.raises(ValueError, match="magpie_cache"):
        prompts.load_sources(["magpie"])
    with pytest.raises(FileNotFoundError, match="no such magpie query cache"):
        prompts.load_sources(["magpie"], magpie_cache=tmp_path / "missing.jsonl")


def test_pool_of_a_grown_cache_leaves_out_the_earlier_pool(tmp_path, tokenizer, fake_decoding):
    cache = tmp_path / "q.jsonl"
    magpie.sample_queries(TARGET, tokenizer, cache, num_queries=6, settings=_settings(tokenizer))
    first = prompts.build_pool(prompts.load_sources(["magpie"], magpie_cache=cache), {}).records
    magpie.sample_queries(TARGET, tokenizer, cache, num_queries=12, settings=_settings(tokenizer))
    rows = prompts.load_sources(["magpie"], magpie_cache=cache)
    old_ids = [r["id"] for r in first]
    # a new request that only rewords an earlier one is not new
    reworded = prompts.PromptRow("magpie/3-999999", "magpie", first[0]["messages"][0]["content"] + " Thanks!")
    rows["magpie"].append(reworded)
    second = prompts.build_pool(rows, {}, exclude_ids=old_ids)
    new_ids = [r["id"] for r in second.records]
    assert len(new_ids) == 6 and not set(new_ids) & set(old_ids)
    assert {i for i, _ in magpie.queries(cache)} == set(old_ids) | set(new_ids)
    assert second.removed["in_earlier_pool"] == {"magpie": 6}
    assert second.removed["near_duplicate"] == {"magpie": 1}
    assert second.stages[-1] == ("new_only", {"magpie": 6})
    # the earlier pool is rebuilt, record for record, from the grown cache's first requests
    again = prompts.build_pool(prompts.load_sources(["magpie"], magpie_cache=cache, magpie_first=6), {})
    assert again.records == first
    with pytest.raises(ValueError, match="fewer than the first 13"):
        prompts.load_sources(["magpie"], magpie_cache=cache, magpie_first=13)
