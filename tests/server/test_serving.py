"""The serving library's kernels without HTTP: the sampler, the request checks, the in-memory caches."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvdb.errors import InvalidArgument
from kvdb.model import loading as lm_ops
from kvdb.serving import Request, Sampling
from kvdb.serving.engine import ARCHIVE_READ_PER_TOKEN, Engine
from kvdb.serving.generation import pick
from kvdb.serving.recent import RecentCaches
from kvdb.serving.relay import title_of

LOGITS = torch.log(torch.tensor([0.05, 0.6, 0.3, 0.05]))


def test_pick_is_greedy_at_temperature_0_and_keeps_to_the_nucleus():
    assert pick(LOGITS, Sampling(temperature=0), torch.Generator()) == 1
    drawn = {pick(LOGITS, Sampling(temperature=1, top_p=0.8), torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {1, 2}  # 0.6 + 0.3 covers 0.8: the two unlikely tokens are never drawn
    assert {pick(LOGITS, Sampling(temperature=1, top_p=1), torch.Generator().manual_seed(s)) for s in range(200)} == {
        0,
        1,
        2,
        3,
    }


def test_a_chat_is_named_by_its_first_words_cut_on_a_word_with_an_ellipsis():
    long = (
        "Could you explain how the harbour master keeps the ledger of incoming ships "
        "during the long winter nights, lamp by lamp?"
    )
    named = title_of(long, "chat")
    assert named.endswith("ships…") and len(named) <= 80 and long.startswith(named[:-1])
    assert title_of("Where is the ledger?", "chat") == "Where is the ledger?" and title_of("  ", "chat") == "chat"


@pytest.mark.parametrize(
    "make",
    [
        lambda: Sampling(temperature=-1),
        lambda: Sampling(top_p=0),
        lambda: Sampling(max_tokens=0),
        lambda: Sampling(max_tokens=True),
        lambda: Sampling(stop=["a", "b", "c", "d", "e"]),
        lambda: Sampling(stop=[""]),
        lambda: Request(),
        lambda: Request(messages=[], prompt="x"),
        lambda: Request(prompt="x", at=3),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(make):
    with pytest.raises(InvalidArgument):
        make()


def test_recent_caches_give_a_view_of_the_shared_prefix_that_generation_cannot_change(tiny_loaded):
    ids = np.arange(10, 30)
    whole = lm_ops.prefill(tiny_loaded.model, ids)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in whole.layers]
    recent = RecentCaches()
    recent.put(ids, whole)
    held, cache, approximate = recent.best(np.concatenate([ids[:12], [1, 2, 3]]), limit=14)
    assert (held, cache.get_seq_length(), approximate) == (12, 12, False)
    assert (
        cache.layers[0].keys.untyped_storage().data_ptr() == whole.layers[0].keys.untyped_storage().data_ptr()
    )  # no copy
    cache.crop(-1)  # what generation does: crop the last position, run it again and the new ones
    lm_ops.prefill(tiny_loaded.model, np.concatenate([ids[:12], [1, 2, 3]]), cache=cache)
    assert cache.get_seq_length() == 15
    held, again, _ = recent.best(ids, limit=len(ids) - 1)  # the entry itself was neither cropped nor overwritten
    assert held == again.get_seq_length() == 19
    assert all(
        torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        for layer, (k, v) in zip(whole.layers, before, strict=True)
    )
    assert recent.best(np.array([5, 6]), limit=2) is None
    assert recent.best(ids, limit=5, exact_only=True)[0] == 5


def test_the_archiver_gives_way_to_requests():
    """Background work takes the model only once no request has held or waited for it for a
    moment, so the next turn of a conversation is not queued behind archiving the last one."""
    import threading
    import time

    from kvdb.serving.gate import ModelGate

    gate, order = ModelGate(size=4, timeout=5), []
    release = gate.admit()  # a reply in progress

    def archive():
        with gate.held(idle=0.2):
            order.append(("archived", time.monotonic()))

    worker = threading.Thread(target=archive)
    worker.start()
    time.sleep(0.05)
    release()  # the reply ends; the next turn comes at once
    with gate.admitted():
        order.append(("next turn", time.monotonic()))
    worker.join(timeout=5)
    assert [what for what, _ in order] == ["next turn", "archived"]
    assert order[1][1] - order[0][1] >= 0.2  # it waited for the model to be idle


def _generated(loaded, messages, cache=None):
    from kvdb.model import chat
    from kvdb.model import tokenizer as tok
    from kvdb.serving.generation import Generation

    ids = np.asarray(
        tok.encode(loaded.tokenizer, chat.render(loaded.tokenizer, messages, add_generation_prompt=True)),
        dtype=np.int64,
    )
    generation = Generation(
        loaded,
        lm_ops.new_cache(loaded.model) if cache is None else cache(ids),
        ids,
        Sampling(temperature=0),
        12,
        lambda: False,
    )
    list(generation.deltas())
    return ids, generation


@pytest.mark.parametrize("held", [0, 10])
def test_generation_hands_over_the_log_probabilities_of_all_it_ran(tiny_loaded, held):
    """What the archive takes from a reply: the log-probabilities of the prompt's tokens past the
    cache it started from (the cache's last token is run again for the first of them) and of each
    generated token, as a fresh scoring pass gives them, and the cache of all but the last token."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    ids, generation = _generated(
        tiny_loaded, messages, (lambda ids: lm_ops.prefill(tiny_loaded.model, ids[:held])) if held else None
    )
    computed = generation.computed
    everything = np.concatenate([ids, generation.tokens])
    assert np.array_equal(computed.ids, everything) and computed.start == held and len(generation.tokens) > 1
    assert computed.cache.get_seq_length() == len(everything) - 1
    expected, _ = lm_ops.score(tiny_loaded.model, everything)
    np.testing.assert_allclose(computed.logprobs, expected[held:], atol=2e-3)


def test_an_exchange_is_archived_from_the_pass_that_generated_it(tiny_loaded, tmp_path, monkeypatch):
    """One model pass per reply: the archive takes generation's log-probabilities and cache, and
    runs the model only past where the archived tokens part from the generated ones (the chat
    template's closing tokens; more where the reply's text tokenizes otherwise, as the tiny
    model's broken UTF-8 does); what it stores is what an ingest of the exchange alone stores,
    and the exchange's cache is kept for a later process."""
    import kvdb
    from kvdb.index import trie

    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt, generation = _generated(tiny_loaded, messages)
    exchange = [*messages, {"role": "assistant", "content": generation.text}]
    ran: list[int] = []
    score, prefill = lm_ops.score_and_next, lm_ops.prefill
    monkeypatch.setattr(
        lm_ops,
        "score_and_next",
        lambda model, ids, start=0, cache=None, *rest: (
            ran.append(len(ids) - start) or score(model, ids, start, cache, *rest)
        ),
    )
    monkeypatch.setattr(
        lm_ops,
        "prefill",
        lambda model, ids, *args, cache=None, **kw: (
            ran.append(len(ids)) or prefill(model, ids, *args, cache=cache, **kw)
        ),
    )
    with kvdb.open(tmp_path / "served.duckdb", model=tiny_loaded) as served:
        [r] = served.ingest(messages=exchange, computed=generation.computed, keep_cache=True)
        handed_over = served.logprobs(r.session_id)
        archived = served.tokens(r.session_id)
        assert len(served._prefix_cache.entries()) == 1
    shared = trie.common_prefix(generation.computed.ids, archived)
    assert r.status == "ingested" and shared >= len(prompt) and sum(ran) == len(archived) - shared, ran
    ran.clear()
    with kvdb.open(tmp_path / "plain.duckdb", model=tiny_loaded) as plain:
        [again] = plain.ingest(messages=exchange)
        np.testing.assert_allclose(handed_over, plain.logprobs(again.session_id), atol=2e-3)
    assert again.session_id == r.session_id and sum(ran) >= r.n_tokens - 1


def test_a_follow_up_does_not_wait_for_a_busy_archive(tiny_loaded, tmp_path):
    """A follow-up whose start the server holds in memory starts from it while the archive is
    busy (archiving the last exchange, here held busy by a call that waits for the reply): it
    waits for neither the archive call nor the model being held for it."""
    import threading

    import kvdb
    from kvdb.serving import Engine

    engine = Engine(kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded))
    engine.start()
    try:
        first = [{"role": "user", "content": "Tell me about the harbour."}]
        reply = engine.complete(Request(messages=first, sampling=Sampling(max_tokens=4, temperature=0))).result()
        replied, busy = threading.Event(), threading.Event()
        blocker = threading.Thread(target=lambda: engine._access(lambda _: busy.set() or replied.wait(60)), daemon=True)
        blocker.start()
        assert busy.wait(30)
        follow = [*first, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And then?"}]
        result: list = []
        worker = threading.Thread(
            target=lambda: result.append(
                engine.complete(Request(messages=follow, sampling=Sampling(max_tokens=4, temperature=0))).result()
            )
        )
        worker.start()
        worker.join(60)  # a follow-up that waited for the archive would wait here until the blocker's 60 s ran out
        replied.set()
        assert result and result[0].cached_tokens > 0 and result[0].restored == "exact"
    finally:
        replied.set()
        engine.close()


def test_a_next_turn_starts_from_memory_rather_than_read_an_archived_cache_a_few_tokens_longer(
    tiny_loaded, tmp_path, monkeypatch
):
    """The archived exchange ends with the template's closing tokens, past what generation fed:
    reading all of its cache back for those few costs far more than computing them (engine.py's
    ARCHIVE_READ_PER_TOKEN). Only after a restart, with nothing in memory, is it read."""
    import time

    import kvdb
    from kvdb.model.prefix_cache import PrefixCache
    from kvdb.serving import Engine

    reads: list = []
    load = PrefixCache.load
    monkeypatch.setattr(
        PrefixCache, "load", lambda self, model, wanted: reads.append(wanted) or load(self, model, wanted)
    )
    first = [{"role": "user", "content": "Tell me about the harbour lights and the keeper who kept them lit. " * 5}]

    def turn(engine, messages):
        return engine.complete(Request(messages=messages, sampling=Sampling(max_tokens=4, temperature=0))).result()

    def archived(engine):
        began = time.monotonic()
        while list(engine._journal.pending()) and time.monotonic() - began < 60:
            time.sleep(0.05)
        assert not list(engine._journal.pending())

    engine = Engine(kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded))
    engine.start()
    try:
        reply = turn(engine, first)
        archived(engine)
        follow = [*first, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And then?"}]
        reads.clear()
        again = turn(engine, follow)
        assert again.cached_tokens >= reply.prompt_tokens and reads == []  # memory's, the archive's not read
    finally:
        engine.close()
    engine = Engine(kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded))
    try:
        restarted = turn(engine, follow)
        assert restarted.cached_tokens > again.cached_tokens and reads != []  # the archive's whole exchange
    finally:
        engine.close()


class _Archive:
    """What ``Engine._start`` asks of the archive: a cache of more than ``better_than`` tokens, exact."""

    def __init__(self, position: int):
        self.position, self.asked = position, []

    def resume(self, ids, better_than, mode, max_loss):
        self.asked.append(better_than)
        return (
            SimpleNamespace(cache="archive's", position=self.position, mode="exact", fidelity=None)
            if self.position > better_than
            else None
        )


class _Access:
    busy = False

    def __init__(self, archive: _Archive):
        self.archive = archive

    def __call__(self, read):
        return read(self.archive)


def _engine_over(hit, archive: _Archive):
    """An Engine with only what ``_start`` reads: the caches in memory and the archive."""
    engine = object.__new__(Engine)
    engine._recent = SimpleNamespace(best=lambda ids, limit, exact_only: hit)
    engine._access = _Access(archive)
    engine._max_loss = 1.05
    return engine


def test_an_approximate_hit_in_memory_takes_the_archives_exact_cache_however_short_its_gain():
    limit = 3200  # the archive must hold limit // ARCHIVE_READ_PER_TOKEN = 100 more than an exact hit
    approximate = _Archive(position=1002)
    start = _engine_over((1000, "memory's", True), approximate)._start(np.arange(limit), limit, "auto")
    assert approximate.asked == [1000] and (start.cache, start.held, start.approximate) == ("archive's", 1002, False)
    exact = _Archive(position=1002)
    start = _engine_over((1000, "memory's", False), exact)._start(np.arange(limit), limit, "auto")
    assert exact.asked == [1000 + limit // ARCHIVE_READ_PER_TOKEN] and (start.cache, start.held) == ("memory's", 1000)
