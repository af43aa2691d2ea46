"""The prefix trie: shared prefixes stored once, turns appended cheaply, deletes that never break
a session that shares nodes, and d_T as a sum along the path."""

import numpy as np
import pytest
import torch
from support import storage_of

import kvdb
from kvdb.index import trie
from kvdb.model import chat
from kvdb.model import loading as lm_ops
from kvdb.model import tokenizer as tok

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one short paragraph."}
TURNS = [
    {"role": "user", "content": "How far is the Moon?"},
    {"role": "assistant", "content": "About 384,400 km on average."},
    {"role": "user", "content": "And the Sun?"},
    {"role": "assistant", "content": "About 150 million km, one astronomical unit."},
]


class ForwardCounter:
    """Counts the tokens the model is run over."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += ids.shape[-1]

    def close(self):
        self.handle.remove()


def chat_ids(archive, messages):
    return np.asarray(tok.encode(archive.loaded_model.tokenizer, chat.render(archive.loaded_model.tokenizer, messages)))


def test_shared_system_prompt_is_stored_once(archive):
    a = archive.ingest(messages=[SYSTEM, TURNS[0]], name="moon")[0]
    b = archive.ingest(messages=[SYSTEM, {"role": "user", "content": "How far is Mars?"}], name="mars")[0]
    st = archive.stats()
    shared = trie.common_prefix(archive.tokens(a.session_id), archive.tokens(b.session_id))
    assert shared > 60
    assert st.tokens == a.n_tokens + b.n_tokens
    assert st.stored_tokens == a.n_tokens + b.n_tokens - shared
    for r, messages in ((a, [SYSTEM, TURNS[0]]), (b, [SYSTEM, {"role": "user", "content": "How far is Mars?"}])):
        assert archive.text(r.session_id) == chat.render(archive.loaded_model.tokenizer, messages)
    [prefix] = archive.prefixes()
    assert prefix.tokens == shared and prefix.sessions == 2
    # issue 30: the whole prefix, newlines and all (it was cut to 8 words, spaces folded)
    assert prefix.text == archive.text(a.session_id)[: len(prefix.text)] and "\n" in prefix.text
    with pytest.warns(DeprecationWarning):
        [head] = archive.prefixes(words=3)
    assert (
        " ".join(prefix.text.split()[:3]).startswith(head.text) and head.text.split()[0] == prefix.text.split()[0]
    )  # 0.1: at most 3 words


def test_one_more_turn_stores_and_computes_only_the_turn(archive):
    first = archive.ingest(messages=[SYSTEM, *TURNS[:2]], name="t2")[0]
    stored_before = archive.stats().stored_tokens
    counter = ForwardCounter(archive.loaded_model.model)
    try:
        second = archive.ingest(messages=[SYSTEM, *TURNS], name="t4")[0]
    finally:
        counter.close()
    new = second.n_tokens - first.n_tokens
    assert archive.stats().stored_tokens == stored_before + new
    assert counter.tokens <= new + 1  # the turn, plus the last shared token whose logits predict it
    expected, _ = lm_ops.score(archive.loaded_model.model, archive.tokens(second.session_id))
    np.testing.assert_allclose(archive.logprobs(second.session_id), expected, atol=1e-4)


def test_a_prefix_of_an_archived_session_needs_no_model_run(archive):
    long = archive.ingest(text="abcdefghijklmnopqrstuvwxyz", name="long")[0]
    counter = ForwardCounter(archive.loaded_model.model)
    try:
        short = archive.ingest(text="abcdefghij", name="short")[0]
    finally:
        counter.close()
    assert counter.tokens == 0
    assert archive.text("short") == "abcdefghij" and archive.text("long") == "abcdefghijklmnopqrstuvwxyz"
    assert archive.stats().stored_tokens == long.n_tokens
    archive.upkeep()  # the model's pass, which ingest queued: stored once, shared
    np.testing.assert_array_equal(archive.logprobs(short.session_id), archive.logprobs(long.session_id)[:10])


def test_a_node_is_cut_only_where_a_new_session_shares_min_split_of_its_tokens(archive):
    letters, k = "abcdefghijklmnopqrstuvwxyz", trie.MIN_SPLIT  # one byte a token
    texts = {"a": letters, "few": letters[: k - 1] + "XYZ", "enough": letters[:k] + "XYZ", "short": letters[:3]}
    results = {name: archive.ingest(text=text, name=name)[0] for name, text in texts.items()}
    assert {name: r.new_tokens for name, r in results.items()} == {"a": 26, "few": k + 2, "enough": 3, "short": 3}
    assert archive.stats().nodes == 5  # a cut in two at k, and three nodes of their own: few and short beside it
    assert [n.n_tokens for n in storage_of(archive).node_path(results["enough"].session_id)] == [k, 3]
    assert {name: archive.text(name) for name in texts} == texts and archive.verify(deep=True).ok


def test_children_that_open_alike_are_told_apart_by_their_heads(archive, monkeypatch):
    """Siblings that begin with one token share fewer than MIN_SPLIT tokens: a new session is
    matched against their first tokens (read once), and only the one it shares MIN_SPLIT with
    is read whole (a backfill of logs that all open alike read every sibling per session)."""
    k = trie.MIN_SPLIT
    texts = {f"s{i}": f"Z{i:0{k - 3}d}" + "x" * (k + i) for i in range(30)}  # one first token; fewer than k shared
    for name, text in texts.items():
        archive.ingest(text=text, name=name, keep="tokens,search")
    reads = []
    node_tokens = type(storage_of(archive)).node_tokens
    monkeypatch.setattr(
        type(storage_of(archive)),
        "node_tokens",
        lambda self, node_id, start=0, end=None: reads.append((start, end)) or node_tokens(self, node_id, start, end),
    )
    [again] = archive.ingest(text=texts["s17"] + " and more", name="s17 grown", keep="tokens,search")
    assert again.new_tokens < len(" and more") + 2 and archive.text("s17 grown") == texts["s17"] + " and more"
    assert len([r for r in reads if r != (0, k)]) <= 1  # one sibling read whole, the others by their heads (cached)
    reads.clear()
    archive.ingest(text=texts["s3"] + " too", name="s3 grown", keep="tokens,search")
    assert len(reads) <= 1 and archive.verify(deep=True).ok  # the heads are read once per process


def test_a_grown_log_walks_on_from_its_last_version_and_a_cut_since_walks_from_the_root(archive, monkeypatch):
    """A writer remembers the paths of the sessions it archived (``trie.Written``): each longer
    version walks on from the last one's leaf, one lookup, where a walk from the root looked up a
    node a step of a path that grows a node a version. A node of a remembered path cut since
    (another session shares part of it) breaks the chain read back, and the walk starts at the root."""
    store = storage_of(archive)
    lookups: list = []
    opening = type(store).children_opening
    monkeypatch.setattr(type(store), "children_opening", lambda self, *a: lookups.append(a[0]) or opening(self, *a))
    text = "The keeper's log, day 0."
    [grown] = archive.ingest(text=text, name="log", keep="tokens,search")
    for day in range(1, 6):
        text += f" Day {day}: the lamp lit at dusk, and the ships counted."
        lookups.clear()
        previous, [grown] = grown, archive.ingest(text=text, name="log", keep="tokens,search")
        assert lookups == [previous.session_id]  # the children of the last version's leaf alone
    path = store.node_path(grown.session_id)
    assert len(path) == 6  # a node a version
    day_2 = archive.text(path[2].node_id)
    archive.ingest(text=day_2[: -len(" ships counted.")] + " no ships at all", name="cut", keep="tokens,search")
    assert len(store.node_path(grown.session_id)) == 7  # the third node cut in two
    lookups.clear()
    [again] = archive.ingest(text=text + " Day 6: fog.", name="log", keep="tokens,search")
    assert len(lookups) == 8 and lookups[0] is None  # from the root, down the path of seven
    assert archive.text(again.session_id) == text + " Day 6: fog." and archive.verify(deep=True).ok


def test_delete_and_gc_never_break_a_sharing_session(archive):
    common = "The harbour lights were lit at dusk. "
    a = archive.ingest(text=common + "Ships came home.", name="a")[0]
    b = archive.ingest(text=common + "Nobody sailed.", name="b")[0]
    archive.delete("a")
    assert archive.text("b") == common + "Nobody sailed."
    assert all(h.session_id != a.session_id for h in archive.search("Ships came home", k=20))
    freed = archive.gc()
    assert freed.nodes == 1 and freed.tokens == len("Ships came home.")
    assert archive.text("b") == common + "Nobody sailed."
    assert {h.name for h in archive.search("harbour lights", k=5) if h.exact} == {"b"}
    restored = archive.restore("b", at=b.n_tokens - 1)
    ids = archive.tokens("b")
    with torch.no_grad():
        step = restored.model(torch.as_tensor(ids[-1:])[None], cache=restored.cache).logits[0, -1]
        fresh = restored.model(torch.as_tensor(ids)[None]).logits[0, -1]
    torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)
    assert archive.gc().nodes == 0
    again = archive.ingest(text=common + "Ships came home.", name="a again")[0]
    assert again.session_id == a.session_id and archive.text(again.session_id) == common + "Ships came home."


def test_deleted_session_revived_before_gc_is_searchable(archive):
    archive.ingest(text="alpha beta gamma", name="x")
    archive.delete("x")
    archive.ingest(text="alpha beta gamma", name="x")
    assert [h.name for h in archive.search("beta gamma", k=3) if h.exact] == ["x"]


def test_prefix_bits_add_up_along_the_path(archive):
    common = "Once upon a time, in a quiet village, "
    archive.ingest(text=common + "a baker sang.", name="a")
    archive.ingest(text=common + "a cat slept.", name="b")
    shared = trie.common_prefix(archive.tokens("a"), archive.tokens("b"))
    expected = -archive.logprobs("a")[:shared].sum(dtype=np.float64) / np.log(2)
    assert archive.prefix_bits("a", "b") == pytest.approx(expected)
    assert archive.prefix_bits("a", "b") == pytest.approx(archive.prefix_bits("b", "a"))
    whole = -archive.logprobs("a").sum(dtype=np.float64) / np.log(2)
    assert archive.prefix_bits("a", "a") == pytest.approx(whole)
    assert 0 < archive.prefix_bits("a", "b") < whole


def test_search_finds_phrases_across_node_boundaries(archive):
    archive.ingest(text="red green blue yellow", name="one")
    archive.ingest(text="red green purple", name="two")  # splits the first node after "red green "
    hits = [h for h in archive.search("green blue", k=5) if h.exact]
    assert [(h.name, h.position) for h in hits] == [("one", 4)]
    hits = [h for h in archive.search("green purple", k=5) if h.exact]
    assert [(h.name, h.position) for h in hits] == [("two", 4)]
    shared = {h.name for h in archive.search("red green", k=5) if h.exact}
    assert len(shared) == 1  # stored once, reported once


def test_trie_survives_reopen(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="shared start, then one", name="one")
        db.ingest(text="shared start, then two", name="two")
    with kvdb.open(path, model=tiny_model) as db:
        assert db.text("one") == "shared start, then one" and db.text("two") == "shared start, then two"
        assert db.stats().stored_tokens < db.stats().tokens


MORE = [{"role": "user", "content": "And Mars?"}, {"role": "assistant", "content": "From 55 to 400 million km."}]


def _ingest_in_new_archive(path, model, messages):
    """An Archive of its own, as another process would have: nothing of the last one in memory.
    Ingest queues the model's pass; upkeep makes it, resuming from the prefix cache, and keeps
    the session's cache there (tokens computed: what the pass ran the model over)."""
    with kvdb.open(path, model=model) as db:
        counter = ForwardCounter(db.loaded_model.model)
        try:
            [result] = db.ingest(messages=messages)
            assert counter.tokens == 0
            db.upkeep()
        finally:
            counter.close()
        expected, _ = lm_ops.score(db.loaded_model.model, db.tokens(result.session_id))
        np.testing.assert_allclose(db.logprobs(result.session_id), expected, atol=1e-4)
    with kvdb.open(path, read_only=True) as db:  # the prefix cache is written when the ingesting archive closes
        return result, counter.tokens, db.stats().bytes["prefix_cache"]


def test_a_turn_ingested_by_another_process_computes_only_the_turn(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    first, computed, cached = _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS[:2]])
    assert computed >= first.n_tokens - 1 and cached > 0  # prefilled once, then kept (warmed for a restore)
    second, computed, cached = _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS])
    assert computed <= second.n_tokens - first.n_tokens + 1
    third, computed, _ = _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS, *MORE])
    assert computed <= third.n_tokens - second.n_tokens + 1


@pytest.mark.slow
def test_a_damaged_or_disabled_prefix_cache_costs_time_never_correctness(tmp_path, tiny_model, monkeypatch):
    path = tmp_path / "a.duckdb"
    _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS[:2]])
    second, _, _ = _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS])
    for entry in (tmp_path / "a.duckdb.prefix").iterdir():  # each session's, the second's chained to the first's
        data = bytearray(entry.read_bytes())
        data[-3] ^= 0x10
        entry.write_bytes(bytes(data))
    third, computed, _ = _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS, *MORE])
    assert computed >= third.n_tokens - 1  # the damaged entry was not trusted: the prefix was prefilled
    entries = sorted((tmp_path / "a.duckdb.prefix").iterdir())
    monkeypatch.setenv("KVDB_PREFIX_CACHE_MB", "0")
    fourth, computed, _ = _ingest_in_new_archive(path, tiny_model, [SYSTEM, *TURNS, *MORE, *TURNS[:2]])
    assert computed >= fourth.n_tokens - 1  # nothing read while disabled...
    assert sorted((tmp_path / "a.duckdb.prefix").iterdir()) == entries  # ...and nothing written


def test_gc_deletes_the_prefix_cache_of_deleted_conversations(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    for turns in (TURNS[:2], TURNS):
        with kvdb.open(path, model=tiny_model) as db:
            db.ingest(messages=[SYSTEM, *turns], name=f"t{len(turns)}")
            db.upkeep()
    assert len(list((tmp_path / "a.duckdb.prefix").iterdir())) == 2  # t4's entry holds what it adds to t2's
    with kvdb.open(path, model=tiny_model) as db:
        db.delete("t2")
        assert db.gc().prefix_cache_entries == 0  # t2's entry holds what t4's chains to, and t4 is alive
        db.delete("t4")
        assert db.gc().prefix_cache_entries == 2
    assert list((tmp_path / "a.duckdb.prefix").iterdir()) == []
