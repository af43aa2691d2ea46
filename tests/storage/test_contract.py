"""The storage contract: what every backend behind kvdb.storage.Storage must do, checked the
same way on each (the ``backend`` fixture names them). Rows in, rows out; plans all or nothing."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import numpy as np
import pytest
from support import undo_child_keys

from kvdb.codecs import fractal
from kvdb.errors import ArchiveError, StaleWrite
from kvdb.index import trie
from kvdb.records import Session
from kvdb.storage import Storage, conversation_rows, open_storage, sql
from kvdb.storage.base import (
    AddTiers,
    CollectGarbage,
    ConversationFilter,
    DeleteConversation,
    DeleteSession,
    DropTiers,
    IndexState,
    ModelRow,
    NewNode,
    NodeTiers,
    PutCodebooks,
    PutModel,
    RenameConversation,
    ReplaceIndexState,
    SessionRow,
    SessionWrite,
    Split,
    utc_now,
)
from kvdb.storage.engine import REVISION
from kvdb.storage.sql import NODE_ROW_BYTES

ALPHABET = 300
MODEL = ModelRow(
    "m" * 32, "tiny", "w" * 64, "t" * 64, {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16}
)
BACKENDS = ["duckdb-file", "ducklake"]


@pytest.fixture(params=BACKENDS)
def location(request, tmp_path):
    """Where a fresh archive of this backend lives (a new one per test). The lake is created
    here with its data path: every later open finds it without one."""
    if request.param == "duckdb-file":
        return tmp_path / "contract.duckdb"
    where, data_path = request.getfixturevalue("lake")
    open_storage(where, data_path=data_path).close()
    return where


@pytest.fixture
def storage(location):
    store = open_storage(location)
    store.apply(PutModel(MODEL))
    yield store
    store.close()


def ids_of(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)


def logprobs_of(ids: np.ndarray) -> np.ndarray:
    return -np.linspace(0.5, 3.0, len(ids)).astype(np.float32)


def session_write(
    name: str,
    ids: np.ndarray,
    parent=None,
    matched: int = 0,
    split: Split | None = None,
    keep=frozenset({"tokens", "search"}),
    row=None,
    **node,
) -> SessionWrite:
    """A session whose node holds ids[matched:], under ``parent`` (the path's node before it);
    ``row``: the session row's fields that are not the defaults (source, created_at, metadata)."""
    sid = trie.path_id(MODEL.model_id, ids)
    row = (
        SessionRow(sid, name, f"{name}.txt", MODEL.model_id, utc_now(), len(ids), {"kind": "text"})
        if row is None
        else row
    )
    new = (
        NewNode(sid, parent, matched, ids[matched:], logprobs_of(ids)[matched:], frozenset(keep), **node)
        if matched < len(ids)
        else None
    )
    return SessionWrite(row, ALPHABET, split, new)


def session_row(name: str, ids: np.ndarray, **fields) -> SessionRow:
    row = SessionRow(
        trie.path_id(MODEL.model_id, ids), name, f"{name}.txt", MODEL.model_id, utc_now(), len(ids), {"kind": "text"}
    )
    return dataclasses.replace(row, **fields)


def add(storage: Storage, name: str, ids: np.ndarray, **kw) -> str:
    write = session_write(name, ids, **kw)
    storage.apply(write)
    return write.session.session_id


def branch(storage: Storage, name: str, ids: np.ndarray, keep=frozenset({"tokens", "search"}), row=None, **node) -> str:
    """Add a session where the trie says it attaches, cutting the node it diverges in."""
    match = trie.longest_prefix(storage, MODEL.model_id, ids)
    split, parent = None, None
    if match.node is not None and match.offset < match.node.n_tokens:
        parent = trie.path_id(MODEL.model_id, ids[: match.matched])
        split = Split(match.node.node_id, parent, match.offset)
    elif match.node is not None:
        parent = match.node.node_id
    return add(storage, name, ids, parent=parent, matched=match.matched, split=split, keep=keep, row=row, **node)


def harbour_children(storage: Storage) -> tuple[str, dict[str, np.ndarray]]:
    """A node ``the harbour: l`` with three children that open with the same token ("i") and
    share fewer than ``trie.MIN_SPLIT`` tokens with each other, written as an ingest writes
    them (uncut), and a short one: the node's id, and each session's tokens by name."""
    texts = {
        "night": "the harbour: lights at night",
        "lamps": "the harbour: lamps",
        "keys": "the harbour: lignition keys",
        "lip": "the harbour: lip",
    }
    ids = {name: ids_of(text) for name, text in texts.items()}
    branch(storage, "night", ids["night"])
    branch(storage, "lamps", ids["lamps"])  # cuts "the harbour: l" off
    parent = trie.path_id(MODEL.model_id, ids["night"][:14])
    for name in ("keys", "lip"):
        add(storage, name, ids[name], parent=parent, matched=14)
    return parent, ids


def test_a_walk_reads_the_one_child_that_shares_a_streams_first_tokens(storage):
    """Children are found by their first HEAD_TOKENS tokens, not every child that opens with
    the same token; a shorter child by its first token (decision 0066)."""
    parent, ids = harbour_children(storage)
    node = {name: trie.path_id(MODEL.model_id, ids[name]) for name in ids}
    by_first = storage.children(parent, MODEL.model_id, ord("i"))
    assert sorted(k.node_id for k in by_first) == sorted(node[name] for name in ("night", "keys", "lip"))
    for name in ("night", "keys"):
        kids = storage.children_opening(parent, MODEL.model_id, ids[name][14 : 14 + trie.MIN_SPLIT])
        assert sorted(k.node_id for k in kids) == sorted([node[name], node["lip"]])  # "ip" is two tokens: keyed by "i"
    [lip] = storage.children_opening(parent, MODEL.model_id, ids["lip"][14:])  # "ip": no eight tokens to look up by
    assert lip.node_id == node["lip"]
    assert [k.node_id for k in storage.children_opening(parent, MODEL.model_id, ids_of("ignore it"))] == [
        node["lip"]
    ]  # shares "ig" with two: fewer than a head
    new = ids_of("the harbour: lignition keys turned")
    match = trie.longest_prefix(storage, MODEL.model_id, new, min_split=trie.MIN_SPLIT, heads=trie.Heads())
    assert (
        match.node is not None
        and match.node.node_id == trie.path_id(MODEL.model_id, ids["keys"])
        and match.matched == len(ids["keys"])
    )


def test_an_archive_of_0013_finds_its_nodes_by_their_first_token(location):
    """Migration 0014 keys the nodes before it by their first token alone: a walk finds them
    by it and tells them apart by their heads, and nodes written after get keys of their own."""
    storage = open_storage(location)
    storage.apply(PutModel(MODEL))
    parent, ids = harbour_children(storage)
    conn = storage.engine.connection()
    undo_child_keys(conn)
    conn.execute("update alembic_version set version_num = '0013'")
    storage.close()
    storage = open_storage(location)  # upgraded
    try:
        assert storage.engine.schema_revision() == REVISION
        old = storage.children_opening(parent, MODEL.model_id, ids["keys"][14 : 14 + trie.MIN_SPLIT])
        assert len(old) == 3  # "ights at night", "ignition keys", "ip": each keyed by "i" alone
        new = ids_of("the harbour: lignition keys turned")
        match = trie.longest_prefix(storage, MODEL.model_id, new, min_split=trie.MIN_SPLIT, heads=trie.Heads())
        assert (
            match.node is not None
            and match.node.node_id == trie.path_id(MODEL.model_id, ids["keys"])
            and match.matched == len(ids["keys"])
        )
        add(storage, "turned", new, parent=match.node.node_id, matched=match.matched)
        [kid] = storage.children_opening(
            match.node.node_id, MODEL.model_id, new[match.matched :][: trie.MIN_SPLIT]
        )  # " turned": keyed by its 8 tokens
        assert kid.node_id == trie.path_id(MODEL.model_id, new)
    finally:
        storage.close()


def test_a_fresh_archive_is_empty(storage):
    assert storage.list_sessions() == [] and storage.shared_nodes() == [] and storage.node_shapes() == []
    assert storage.byte_counts()["sessions"] == 0 and storage.byte_counts()["token_bytes"] == 0
    assert storage.get_session("nope") is None and not storage.has_session("nope")
    assert storage.index_state("k") is None and storage.index_keys() == []


def test_models_register_once(storage):
    storage.apply(PutModel(dataclasses.replace(MODEL, name="renamed")))  # the same id again: kept as first written
    assert storage.get_model(MODEL.model_id) == MODEL
    assert storage.model_ids_with_tokenizer(MODEL.tokenizer_hash) == [MODEL.model_id]
    assert storage.tokenizer_hashes() == [MODEL.tokenizer_hash]
    assert storage.get_model("other") is None


def test_a_session_reads_back_whole_and_in_ranges(storage):
    ids = ids_of("the harbour lights at night " * 20)
    sid = add(storage, "story", ids)
    [row] = storage.list_sessions()
    assert (row.session_id, row.name, row.n_tokens, row.metadata) == (sid, "story", len(ids), {"kind": "text"})
    assert storage.has_session(sid) and storage.get_session(sid) == row
    assert (
        storage.match_sessions("story") == [row]
        and storage.match_sessions(sid[:6]) == [row]
        and storage.match_sessions("zz") == []
    )
    np.testing.assert_array_equal(storage.load_tokens(sid), ids)
    np.testing.assert_array_equal(storage.load_tokens(sid, 7, 333), ids[7:333])
    np.testing.assert_allclose(storage.load_logprobs(sid), logprobs_of(ids))
    [node] = storage.node_path(sid)
    assert (node.node_id, node.parent_id, node.start, node.n_tokens, node.refcount, node.keep) == (
        sid,
        None,
        0,
        len(ids),
        1,
        {"tokens", "search"},
    )
    assert (
        storage.children(None, MODEL.model_id, int(ids[0])) == [node]
        and storage.children(None, MODEL.model_id, int(ids[0]) + 1) == []
    )
    assert storage.nodes_of([MODEL.model_id]) == [node]
    assert storage.node_shapes() == [(node, ALPHABET, fractal.DEFAULT_BLOCK)]
    assert storage.max_alphabet([MODEL.model_id]) == ALPHABET
    assert storage.logprob_lengths() == {sid: len(ids)}
    blocks = fractal.blocks_for_range(0, len(ids), fractal.DEFAULT_BLOCK)
    assert set(storage.load_blocks([(sid, k) for k in blocks])) == {(sid, k) for k in blocks}
    counts = storage.byte_counts()
    assert (
        counts["sessions"] == 1
        and counts["tokens"] == counts["stored_tokens"] == len(ids)
        and counts["logprob_bytes"] == 4 * len(ids)
    )


def test_a_search_reads_its_hits_conversations_by_id_titled_as_the_listing_titles_them(storage):
    """A search labels its hits with their conversations (``conversation_rows``), read by id: the
    same rows the listing gives, titled by the file's title where it is a non-empty string,
    escapes and all, else by the first version's name. An id that names none is left out."""
    titles = ['Tokyo \u2192 Kyoto "JR" \\ pass', "", 7, None]
    conversations = []
    for n, title in enumerate(titles):
        ids = ids_of(f"session {n} " * (n + 3))
        metadata = {"kind": "text"} | ({} if title is None else {"title": title})
        conversations.append(
            conversation_of(storage, add(storage, f"s{n}", ids, row=session_row(f"s{n}", ids, metadata=metadata)))
        )
    rows = storage.conversation_rows([*conversations[::-1], "no such conversation"])
    listed = storage.conversations_page(ConversationFilter()).conversations
    assert sorted(rows, key=lambda r: r.latest.conversation_id) == sorted(
        listed, key=lambda r: r.latest.conversation_id
    )
    by_id = {r.latest.conversation_id: r.title for r in rows}
    assert [by_id[c] for c in conversations] == [titles[0], "s1", "s2", "s3"]


def test_the_trie_s_shape_a_search_reads_is_its_nodes_and_sessions(storage):
    """``trie_shape``, the view a search loads, holds what ``node_shapes`` reads of each node and
    what ``list_sessions`` reads of each session, in its order; a node from before migration 0005,
    whose ``keep`` is NULL, keeps what ``NodeRow`` says it keeps."""
    ids = ids_of("a shared opening line, then one way " * 3)
    first = add(storage, "first", ids)
    branch(storage, "second", np.concatenate([ids[:60], ids_of("and then another way entirely " * 3)]))
    storage.engine.connection().execute("update nodes set keep = NULL where node_id = ?", [first])
    shape = storage.trie_shape()
    nodes = {n.node_id: (n.parent_id or "", n.start, n.end, n.keep, a, b) for n, a, b in storage.node_shapes()}
    columns = (
        shape.parent_id,
        shape.start,
        shape.end,
        shape.keep,
        shape.alphabet,
        shape.block_size,
    )
    assert len(nodes) == 3 and dict(zip(shape.node_id, zip(*columns, strict=True), strict=True)) == nodes
    assert nodes[first][3] == frozenset({"search"})
    sessions = storage.list_sessions()
    assert list(zip(shape.session_id, shape.name, shape.conversation_id, strict=True)) == [
        (r.session_id, r.name, r.conversation_id) for r in sessions
    ]


def test_byte_counts_count_text_in_utf8_bytes(storage):
    """A session named outside ASCII (a file called café.txt) is counted, not a conversion error:
    the text was once cast to a blob, which DuckDB refuses for any byte above 0x7f."""
    empty = storage.byte_counts()["metadata_bytes"]
    add(storage, "café", ids_of("a session named outside ascii"))
    counts = storage.byte_counts()
    [row] = storage.list_sessions()
    expected = (
        len(row.name.encode()) + len(row.source.encode()) + len(json.dumps(row.metadata, sort_keys=True).encode())
    )
    assert counts["metadata_bytes"] - empty == expected + NODE_ROW_BYTES and storage.match_sessions("café") == [row]


def test_a_split_keeps_both_paths_and_their_tiers(storage):
    a = ids_of("shared system prompt; then one story " * 4)
    b = np.concatenate([a[:50], ids_of("another turn entirely, longer than before")])
    sid_a = add(storage, "a", a, kv=("books", {16: np.arange(len(a) * 3) % 16}))
    storage.apply(ReplaceIndexState(IndexState("k", ALPHABET, 4, len(a), 1, {sid_a: 0})))
    sid_b = branch(storage, "b", b)
    path_a, path_b = storage.node_path(sid_a), storage.node_path(sid_b)
    assert path_a[0] == path_b[0] and path_a[0].n_tokens == 50 and path_a[0].refcount == 2
    assert [n.refcount for n in path_a[1:] + path_b[1:]] == [1, 1]
    assert storage.shared_nodes() == [path_a[0]]
    np.testing.assert_array_equal(storage.load_tokens(sid_a), a)
    np.testing.assert_array_equal(storage.load_tokens(sid_b), b)
    np.testing.assert_allclose(storage.load_logprobs(sid_a), logprobs_of(a))
    head_kv, tail_kv = storage.node_kv(path_a[0].node_id), storage.node_kv(sid_a)
    np.testing.assert_array_equal(np.concatenate([head_kv[1][16], tail_kv[1][16]]), np.arange(len(a) * 3) % 16)
    runs = {r[0]: r[1:] for r in storage.slot_runs("k")}  # the index's slot run is cut with the node
    assert runs == {path_a[0].node_id: (0, 50, 0), sid_a: (50, len(a) - 50, 50)}


def test_session_paths_are_node_paths_read_at_once(storage):
    """Sessions' paths in one read (a grown log's unchanged parts): the archived ones, each as
    ``node_path`` gives it; an id that is no session (a node the split made, or none) is left out."""
    a = ids_of("shared system prompt; then one story " * 4)
    sid_a = add(storage, "a", a)
    sid_b = branch(storage, "b", np.concatenate([a[:50], ids_of("another turn entirely, longer than before")]))
    shared = storage.node_path(sid_b)[0].node_id
    paths = storage.session_paths([sid_a, sid_b, shared, "no-such-session"])
    assert paths == {sid_a: storage.node_path(sid_a), sid_b: storage.node_path(sid_b)} and len(paths[sid_a]) == 2
    assert storage.session_paths([]) == {}


def test_tier_l_only_nodes_get_their_tokens_back(storage):
    ids = ids_of("coded against the model only " * 3)
    sid = add(storage, "lm", ids, keep={"lm"}, lm=b"KL-payload")
    [node] = storage.node_path(sid)
    assert node.keep == {"lm"} and storage.node_lm_payload(sid) == b"KL-payload"
    with pytest.raises(ValueError, match="no token blocks"):
        storage.node_tokens(sid)
    storage.apply(DropTiers({}, {sid: (ids, logprobs_of(ids))}))
    np.testing.assert_array_equal(storage.node_tokens(sid), ids)
    assert storage.node_path(sid)[0].keep == {"lm", "tokens"}
    more = ids_of("another session coded against the model only")
    other = add(storage, "other", more, keep={"lm"}, lm=b"KL-payload")
    storage.apply(
        AddTiers({other: NodeTiers(tokens=(more, logprobs_of(more)))})
    )  # the plan that gives tiers to archived nodes
    assert storage.node_path(other)[0].keep == {"lm", "tokens"}
    np.testing.assert_array_equal(storage.load_tokens(other), more)
    np.testing.assert_allclose(storage.load_logprobs(other), logprobs_of(more))


def test_dropping_and_adding_tiers(storage):
    ids = ids_of("a session that will lose tiers " * 3)
    sid = add(storage, "s", ids, keep={"tokens", "search", "lm"}, lm=b"payload")
    storage.apply(DropTiers({sid: {"search", "lm"}}))
    assert storage.node_path(sid)[0].keep == {"tokens"} and storage.node_lm_payload(sid) is None
    storage.apply(PutCodebooks("books", MODEL.model_id, "k2v1", b"codebook bytes"))
    storage.apply(
        AddTiers(
            {sid: NodeTiers(lm=b"coded again", kv=("books", {16: np.arange(len(ids)) % 16}))},
            IndexState("k", ALPHABET, 4, len(ids), 1, {sid: 0}),
        )
    )
    assert (
        storage.node_path(sid)[0].keep == {"tokens", "search", "lm", "kv"}
        and storage.node_lm_payload(sid) == b"coded again"
    )
    assert storage.slot_runs("k") == [(sid, 0, len(ids), 0)] and storage.index_generation("k") == (1, len(ids))
    codebook_id, streams = storage.node_kv(sid)
    assert codebook_id == "books" and list(streams) == [16]
    assert (
        storage.codebooks_for(MODEL.model_id) == ("books", b"codebook bytes")
        and storage.codebook_data("books") == b"codebook bytes"
    )
    assert storage.dangling_references() == []
    assert storage.byte_counts()["kv_tokens"] == len(ids)


def test_delete_then_collect_garbage(storage):
    a = ids_of("the common beginning, then a " * 3)
    b = np.concatenate([a[:40], ids_of("different ending")])
    sid_a, sid_b = add(storage, "a", a), None
    sid_b = branch(storage, "b", b)
    storage.apply(DeleteSession(sid_a))
    assert [s.session_id for s in storage.list_sessions()] == [sid_b]
    assert storage.node_path(sid_b)[0].refcount == 1 and storage.node_path(sid_a)[-1].refcount == 0
    freed = storage.apply(CollectGarbage())
    assert freed["nodes"] == 1 and freed["tokens"] == len(a) - 40 and freed["token_bytes"] > 0
    assert storage.node_path(sid_a) == [] and len(storage.node_shapes()) == 2
    np.testing.assert_array_equal(storage.load_tokens(sid_b), b)


def test_index_state_round_trips(storage):
    ids = ids_of("indexed tokens " * 4)
    sid = add(storage, "s", ids)
    storage.apply(ReplaceIndexState(IndexState("k", ALPHABET, 4, len(ids), 3, {sid: 0})))
    assert storage.index_state("k") == IndexState("k", ALPHABET, 4, len(ids), 3, {sid: 0})
    assert storage.index_generation("k") == (3, len(ids)) and storage.index_keys() == ["k"]
    assert storage.slot_runs("k") == [(sid, 0, len(ids), 0)]
    storage.apply(DeleteSession(sid))
    assert storage.slot_runs("k") == []  # a node nobody uses drops out of search at once


def test_index_state_from_a_slot_gives_the_runs_a_reader_lacks(storage):
    a, b = ids_of("the first run of slots " * 2), ids_of("and a second one")
    sid_a, sid_b = add(storage, "a", a), add(storage, "b", b)
    storage.apply(ReplaceIndexState(IndexState("k", ALPHABET, 4, len(a), 3, {sid_a: 0})))
    storage.apply(AddTiers({}, IndexState("k", ALPHABET, 4, len(a) + len(b), 3, {sid_b: len(a)})))
    assert storage.index_state("k").ranges == {sid_a: 0, sid_b: len(a)}
    assert storage.index_state("k", len(a)) == IndexState("k", ALPHABET, 4, len(a) + len(b), 3, {sid_b: len(a)})
    assert storage.index_state("k", len(a) + len(b)).ranges == {}


def test_nodes_tokens_reads_whole_nodes_at_once(storage):
    a = ids_of("a shared opening, then one ending " * 3)
    b = np.concatenate([a[:30], ids_of("and another ending, longer than a block of tokens " * 100)])
    sid_a, sid_b = add(storage, "a", a), branch(storage, "b", b)
    path = storage.node_path(sid_b)
    got = storage.nodes_tokens([n.node_id for n in path] + [sid_a])
    assert list(got) == [n.node_id for n in path] + [sid_a]
    np.testing.assert_array_equal(np.concatenate([got[n.node_id] for n in path]), b)
    np.testing.assert_array_equal(got[sid_a], a[30:])
    assert storage.nodes_tokens([]) == {}


def test_token_blocks_are_read_as_the_pairs_asked_for_however_many_nodes(storage, monkeypatch):
    """``load_blocks`` reads its nodes a batch at a time (``LIST_LITERAL`` of them; 2 here, so
    that six nodes make three) and keeps only the (node, block) pairs asked for: a block of a
    node asked for is left out unless it is asked for."""
    monkeypatch.setattr(sql, "LIST_LITERAL", 2)
    long = add(storage, "long", np.arange(3 * fractal.DEFAULT_BLOCK) % 250)
    short = [add(storage, f"s{n}", (np.arange(40) * (n + 3) + n) % 250) for n in range(5)]
    wanted = [(long, 0), (long, 2), *((sid, 0) for sid in short)]
    read = storage.load_blocks(wanted)
    assert sorted(read) == sorted(wanted)
    assert all(read[pair] == storage.load_blocks([pair])[pair] for pair in [(long, 2), (short[-1], 0)])
    assert storage.load_blocks([]) == {}


def test_stored_blobs_and_their_sample(storage):
    ids = np.arange(5 * fractal.DEFAULT_BLOCK) % 250
    sid = add(storage, "s", ids)
    every = list(storage.stored_blobs("tokens"))
    assert len(every) == len(fractal.blocks_for_range(0, len(ids), fractal.DEFAULT_BLOCK)) and {
        b[0] for b in every
    } == {sid}
    assert 0 < len(list(storage.stored_blobs("tokens", sample=2))) < len(every)


def test_dangling_references_name_what_is_missing(location):
    store = open_storage(location)
    try:
        sid = add(store, "orphan", ids_of("no model row for this one"))
        assert ("session", sid, "model", MODEL.model_id) in store.dangling_references()
    finally:
        store.close()


def test_version_moves_on_writes_not_on_reads(storage):
    before = storage.version()
    storage.list_sessions()
    storage.release()
    storage.list_sessions()
    assert storage.version() == before
    add(storage, "s", ids_of("a write"))
    assert storage.version() != before


def test_version_moves_when_another_client_writes(storage, location):
    storage.list_sessions()
    storage.release()  # hand the lock back, as ingest does while the model works
    before = storage.version()
    other = open_storage(location)
    try:
        add(other, "from elsewhere", ids_of("written by another client"))
    finally:
        other.close()
    assert storage.version() != before
    assert [s.name for s in storage.list_sessions()] == ["from elsewhere"]


def test_release_and_hold(storage):
    storage.list_sessions()
    assert storage.held_for() >= 0.0
    storage.release()
    assert storage.held_for() == 0.0
    assert storage.list_sessions() == []  # the next call takes the storage again


def test_a_failed_plan_changes_nothing(storage):
    ids = ids_of("tokens and too few log-probabilities")
    write = session_write("bad", ids)
    broken = dataclasses.replace(write, node=dataclasses.replace(write.node, logprobs=write.node.logprobs[:-1]))
    with pytest.raises(ValueError):
        storage.apply(broken)
    assert storage.list_sessions() == [] and storage.node_shapes() == []
    add(storage, "first", ids)
    again = session_write("again", ids_of("a node that must not outlive the failed write"))
    clash = dataclasses.replace(
        again, session=dataclasses.replace(again.session, session_id=storage.list_sessions()[0].session_id)
    )
    with pytest.raises(StaleWrite):  # the session row clashes after the node's rows went in: all of it rolls back
        storage.apply(clash)
    assert [s.name for s in storage.list_sessions()] == ["first"] and len(storage.node_shapes()) == 1


def test_read_only_refuses_plans_but_repairs_derived_data(storage, location):
    add(storage, "s", ids_of("one session"))
    storage.close()
    reader = open_storage(location, read_only=True)
    try:
        with pytest.raises(ArchiveError, match="read-only"):
            reader.apply(DeleteSession(reader.list_sessions()[0].session_id))
        with reader.writable():
            reader.apply(ReplaceIndexState(IndexState("k", ALPHABET, 4, 0, 1, {})))
        assert reader.index_generation("k") == (1, 0) and reader.read_only
    finally:
        reader.close()


def test_derived_paths_sit_beside_the_archive(storage):
    index, prefix = storage.derived_path(".index"), storage.derived_path(".prefix")
    assert index != prefix and index.parent == prefix.parent
    assert storage.describe() and storage.footprint() > 0


def test_two_commits_that_overlap_conflict_and_the_later_lands_nothing(lake, monkeypatch):
    """A lake has no keys: what keeps a session from being stored twice by two writers is that
    every commit changes one row, so DuckLake refuses the later of two overlapping ones. A plan
    made on a snapshot is refused; one that reads what it touches in its transaction runs again."""
    from kvdb.storage import sql_apply

    where, data_path = lake
    first, second = open_storage(where, data_path=data_path), open_storage(where)
    real = sql_apply.apply

    def interleave(name: str) -> None:  # the other writer commits while this transaction is open
        def interleaved(conn, plan):
            monkeypatch.setattr(sql_apply, "apply", real)
            add(first, name, ids_of(f"committed meanwhile: {name}"))
            return real(conn, plan)

        monkeypatch.setattr(sql_apply, "apply", interleaved)

    try:
        first.apply(PutModel(MODEL))
        planned_at = second.version()
        interleave("first")
        with pytest.raises(StaleWrite, match="another writer"):
            second.apply(session_write("second", ids_of("planned on a snapshot that is gone")), planned_at)
        assert [s.name for s in second.list_sessions()] == ["first"]
        with pytest.raises(StaleWrite):  # and a plan made before a commit that is over is refused as well
            second.apply(session_write("second", ids_of("planned on a snapshot that is gone")), planned_at)
        add(second, "second", ids_of("planned again on a fresh snapshot"))
        interleave("third")
        second.apply(
            DeleteSession(trie.path_id(MODEL.model_id, ids_of("planned again on a fresh snapshot")))
        )  # run again, and lands
        assert sorted(s.name for s in first.list_sessions()) == ["first", "third"]
    finally:
        first.close()
        second.close()


def test_before_compute_keeps_a_fresh_hold_for_short_work_only(storage, monkeypatch):
    """The lock policy lives here, not in the services: long work hands the lock back; short
    work keeps a hold younger than HOLD_SECONDS (a reconnect costs more than the work)."""
    from kvdb.storage import base

    storage.list_sessions()
    held = storage.held_for()
    storage.before_compute(short=True)
    assert storage.held_for() >= held  # kept (0 where the engine holds no lock at all)
    storage.before_compute()
    assert storage.held_for() == 0.0
    storage.list_sessions()
    monkeypatch.setattr(
        base, "HOLD_SECONDS", 0.0
    )  # a hold as old as the limit, and another process waiting: even short work lets go
    monkeypatch.setattr(storage.engine, "wanted", lambda: True)
    storage.before_compute(short=True)
    assert storage.held_for() == 0.0


# conversations: which one a session joins is decided inside its write --------------------------


def conversation_of(storage: Storage, session_id: str) -> str:
    row = storage.get_session(session_id)
    assert row is not None
    return row.conversation_id


def test_a_session_that_extends_one_of_its_source_joins_its_conversation(storage):
    first = branch(storage, "log", ids_of("the keeper lit the lamp at dusk"))
    grown = branch(storage, "log", ids_of("the keeper lit the lamp at dusk and logged the wind"))
    other_source = branch(storage, "copy", ids_of("the keeper lit the lamp at dusk and logged the rain"))
    assert conversation_of(storage, first) == conversation_of(storage, grown) == first  # named by its first session
    assert conversation_of(storage, other_source) == other_source
    assert [r.session_id for r in storage.conversation_sessions(first)] == [first, grown]


def test_a_file_rewritten_forks_its_conversation_and_a_writer_may_name_one(storage):
    first = branch(storage, "log", ids_of("one version of the log"))
    rewritten = branch(storage, "log", ids_of("another version entirely"))  # same file, same name, no shared prefix
    assert conversation_of(storage, rewritten) == first
    write = dataclasses.replace(session_write("chat", ids_of("a chat the server continues")), conversation="c0ffee")
    storage.apply(write)
    assert conversation_of(storage, write.session.session_id) == "c0ffee" and storage.conversation_titles() == {}


def test_deleting_the_last_session_of_a_conversation_deletes_it_and_rename_titles_it(storage):
    first = branch(storage, "log", ids_of("the keeper lit the lamp"))
    grown = branch(storage, "log", ids_of("the keeper lit the lamp and slept"))
    storage.apply(RenameConversation(first, "Lamp"))
    assert storage.conversation_titles() == {first: "Lamp"}
    storage.apply(DeleteSession(first))
    assert conversation_of(storage, grown) == first and storage.conversation_titles() == {
        first: "Lamp"
    }  # one version left
    storage.apply(DeleteSession(grown))
    assert storage.conversation_sessions(first) == [] and storage.conversation_titles() == {}


def test_deleting_a_conversation_deletes_every_version_in_one_plan(storage):
    first = branch(storage, "log", ids_of("the keeper lit the lamp"))
    branch(storage, "log", ids_of("the keeper lit the lamp and slept"))
    kept = branch(storage, "notes", ids_of("unrelated notes about the bay"))
    storage.apply(DeleteConversation(first))
    assert [r.session_id for r in storage.list_sessions()] == [kept]
    assert all(n.refcount == 0 for n in storage.node_path(first))  # uncounted, for gc


# conversations listed in SQL: the conversations table's own columns filter, order and page -------


def listed_in_python(storage: Storage, admits: ConversationFilter) -> list[str]:
    """The conversations a listing admits, chosen as before it ran in SQL: every session read,
    each conversation summed up from its versions by ``Session``'s rules, the latest updated first."""
    grouped: dict[str, list[SessionRow]] = {}
    for row in storage.list_sessions():  # oldest first
        grouped.setdefault(row.conversation_id, []).append(row)
    kept = []
    for conversation, rows in grouped.items():
        first, latest = Session.from_row(rows[0]), Session.from_row(rows[-1])
        project = next((str(r.metadata["cwd"]) for r in rows if r.metadata.get("cwd")), first.project)
        day = latest.said_at.date()
        inside = admits.project is None or (
            project is not None and (project + "/").startswith(admits.project.rstrip("/") + "/")
        )
        since, until = admits.since is None or day >= admits.since, admits.until is None or day <= admits.until
        if (admits.agent is None or first.agent == admits.agent) and inside and since and until:
            kept.append((latest.created_at, conversation))
    return [conversation for _, conversation in sorted(kept, reverse=True)]


FILTERS = [
    ConversationFilter(),
    ConversationFilter(agent="claude-code"),
    ConversationFilter(agent="codex-cli"),
    ConversationFilter(agent="grok"),
    ConversationFilter(project="/work/repo"),  # not /work/repo-other
    ConversationFilter(project="/work/repo/"),
    ConversationFilter(project="/work"),
    ConversationFilter(project="/elsewhere"),
    ConversationFilter(project="/"),  # every conversation about a folder; not text given directly
    ConversationFilter(since=dt.date(2025, 3, 3)),
    ConversationFilter(until=dt.date(2025, 3, 2)),
    ConversationFilter(
        since=dt.date(2025, 3, 5), until=dt.date(2025, 3, 5)
    ),  # the day its log wrote, not UTC's (the 6th)
    ConversationFilter(until=dt.date.max),
    ConversationFilter(agent="claude-code", project="/work/repo", since=dt.date(2025, 3, 1), until=dt.date(2025, 3, 1)),
]


def check_listing(storage: Storage) -> None:
    """Every filter's whole listing and one page of it; the rows themselves and the edges of paging
    once, unfiltered (a lake answers each query in tens of milliseconds, and this runs four times)."""
    for admits in FILTERS:
        expected = listed_in_python(storage, admits)
        every = storage.conversations_page(admits)
        assert [c.latest.conversation_id for c in every.conversations] == expected and every.total == len(expected), (
            admits
        )
        assert sorted(storage.conversation_ids(admits)) == sorted(expected), admits
        if admits == FILTERS[0]:
            for listed in every.conversations:
                versions = storage.conversation_sessions(listed.latest.conversation_id)
                assert (listed.latest, listed.versions) == (versions[-1], len(versions)) and storage.conversation_row(
                    listed.latest.conversation_id
                ) == listed
        pages = [(2, 0), (2, 2), (1, 3), (None, 1), (3, 50), (len(expected), 0)] if admits == FILTERS[0] else [(2, 1)]
        for limit, offset in pages:
            page = storage.conversations_page(admits, limit, offset)
            wanted = expected[offset:][:limit]
            assert [c.latest.conversation_id for c in page.conversations] == wanted and page.total == len(expected), (
                admits,
                limit,
                offset,
            )


def test_conversations_are_filtered_ordered_and_paged_on_their_rows(storage):
    start = dt.datetime(2025, 3, 1, 12)

    def said(name: str, text: str, hours: int, metadata: dict, source: str | None = None) -> str:
        ids = ids_of(text)
        row = session_row(
            name,
            ids,
            source=source or f"/work/repo/{name}.jsonl",
            created_at=start + dt.timedelta(hours=hours),
            metadata=metadata,
        )
        return branch(storage, name, ids, row=row)

    first = said(
        "a",
        "the keeper lit the lamp at dusk",
        0,
        {"format": "claude-code", "cwd": "/work/repo", "ended": "2025-03-01T10:00:00"},
    )
    said(
        "b", "the tide came in", 1, {"format": "codex-cli", "ended": "2025-03-03T00:00:00"}, "/work/repo-other/b.jsonl"
    )
    said("c", "plain notes, no file", 2, {"format": "text"}, "<text>")  # said when archived: the 1st
    said("d", "a log that names no folder", 3, {"format": "claude-code"}, "/work/repo/sub/d.jsonl")
    grown = said(
        "a",
        "the keeper lit the lamp at dusk and logged the wind",
        4,
        {"format": "claude-code", "ended": "2025-03-05T23:30:00-05:00"},
    )
    said(
        "d",
        "a log that names no folder, then its cwd",
        5,
        {"format": "claude-code", "cwd": "/elsewhere"},
        "/work/repo/sub/d.jsonl",
    )
    said("e", "the fog horn", 6, {"format": "claude-code", "ended": "not a time"})
    check_listing(storage)
    a = storage.conversations_page(ConversationFilter(project="/work/repo")).conversations[1]  # after e
    assert (a.latest.session_id, a.versions, a.branches, a.title, a.project, a.agent) == (
        grown,
        2,
        1,
        "a",
        "/work/repo",
        "claude-code",
    )
    assert a.started_at == start  # its first version's, which records no start

    storage.apply(RenameConversation(first, "Lamp"))
    said(
        "b", "the tide came in, an older copy", -1, {"format": "grok"}, "/work/repo-other/b.jsonl"
    )  # archived before b's first version
    check_listing(storage)  # b's first version, its agent, is now that one
    assert [c.title for c in storage.conversations_page(ConversationFilter(project="/work/repo")).conversations] == [
        "e",
        "Lamp",
    ]
    storage.apply(DeleteSession(grown))  # a's latest version is its first again: said on the 1st, updated first of all
    check_listing(storage)
    storage.apply(DeleteConversation(first))
    check_listing(storage)


def test_a_listing_counts_the_ends_of_a_log_that_went_on_in_parts(storage):
    """A whole version that the log's first part is a prefix of goes on in the parts, and a part a
    later part follows is no end either; a whole version the part is no prefix of is one."""
    start = dt.datetime(2025, 3, 1, 12)

    def said(text: str, hours: int, part: dict | None = None) -> str:
        ids = ids_of(text)
        metadata = {"format": "claude-code"} | ({"part": part} if part else {})
        return branch(
            storage,
            "log",
            ids,
            row=session_row(
                "log", ids, source="/work/log.jsonl", created_at=start + dt.timedelta(hours=hours), metadata=metadata
            ),
        )

    whole = said("the keeper lit the lamp at dusk and logged the wind", 0)
    first = said("the keeper lit the lamp", 1, {"number": 1, "follows": None, "starts": 0})
    said(" at dusk and logged the wind and the rain", 2, {"number": 2, "follows": first, "starts": 23})
    [listed] = storage.conversations_page(ConversationFilter()).conversations
    assert (listed.versions, listed.branches, conversation_of(storage, whole)) == (3, 1, listed.latest.conversation_id)
    said("the keeper slept through the dusk and logged nothing", 3)  # the first part is no prefix of it: an end
    assert [
        (c.versions, c.branches) for c in storage.conversations_page(ConversationFilter(), limit=1).conversations
    ] == [(4, 2)]


def test_an_archive_of_0011_gets_its_conversation_rows_filled(location):
    storage = open_storage(location)
    storage.apply(PutModel(MODEL))
    start = dt.datetime(2025, 3, 1, 12)
    for hours, (name, text, metadata) in enumerate(
        [
            ("a", "the keeper lit the lamp", {"format": "claude-code", "ended": "2025-03-04T08:00:00"}),
            ("a", "the keeper lit the lamp and slept", {"format": "claude-code", "cwd": "/work/repo"}),
            ("b", "the tide came in", {"format": "codex-cli"}),
            ("c", "a session no write grouped", {"format": "text"}),
        ]
    ):
        ids = ids_of(text)
        branch(
            storage,
            name,
            ids,
            row=session_row(
                name, ids, source=f"/work/{name}.jsonl", created_at=start + dt.timedelta(hours=hours), metadata=metadata
            ),
        )
    [a] = [c for c in storage.conversation_ids(ConversationFilter()) if len(storage.conversation_sessions(c)) == 2]
    storage.apply(RenameConversation(a, "Lamp"))
    expected = {admits: listed_in_python(storage, admits) for admits in FILTERS}
    [ungrouped] = storage.conversation_ids(ConversationFilter(agent="text"))
    conn = storage.engine.connection()
    for name in conversation_rows.SUMMARY:
        conn.execute(f"alter table conversations drop column {name}")
    conn.execute(
        "delete from conversation_sessions where session_id = ?", [ungrouped]
    )  # as no write leaves it: a conversation of its own
    conn.execute("delete from conversations where conversation_id = ?", [ungrouped])
    if conn.execute("select count(*) from duckdb_indexes() where index_name like '%\\_node' escape '\\'").fetchone()[
        0
    ]:  # a file (a lake has no indexes)
        for table in ("token_blocks", "node_kv", "node_chunks", "search_ranges"):
            conn.execute(f"drop index ix_{table}_node")  # added by 0013
    undo_child_keys(conn)
    conn.execute("update alembic_version set version_num = '0011'")
    storage.close()
    storage = open_storage(location)  # upgraded: the rows filled as a write fills them
    try:
        assert storage.engine.schema_revision() == REVISION and {a: "Lamp"} == storage.conversation_titles()
        assert {admits: listed_in_python(storage, admits) for admits in FILTERS} == expected
        check_listing(storage)
    finally:
        storage.close()
