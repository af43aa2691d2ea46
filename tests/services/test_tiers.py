"""Tier policy: --keep at ingest, tier L coded per trie node, restore from tier L alone, compact."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from support import CALIBRATION, KV, storage_of, write

import kvdb
from kvdb.cli.main import main
from kvdb.errors import ArchiveError, ArchiveLocked, InvalidArgument
from kvdb.index import trie
from kvdb.model import capture, lmcode
from kvdb.services.tier_k import TierK

ALL = "tokens,search,lm"
TURN1 = [{"role": "user", "content": "Name a red fruit."}, {"role": "assistant", "content": "A strawberry."}]
TURN2 = TURN1 + [{"role": "user", "content": "And a yellow one?"}, {"role": "assistant", "content": "A banana."}]


def assert_cache_matches_prefill(restored, ids):
    """The restored cache continues the session as a fresh prefill of the same tokens would."""
    with torch.no_grad():
        step = restored.model(torch.as_tensor(ids[restored.position :][:1])[None], cache=restored.cache).logits[0, -1]
        fresh = restored.model(torch.as_tensor(ids[: restored.position + 1])[None]).logits[0, -1]
    torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)


def test_lm_tier_restores_by_decoding_alone(archive):
    [r] = archive.ingest(text="Tier L holds the tokens coded against the model itself.", keep=ALL, name="l")
    st = archive.stats()
    assert st.bytes["lm"] > 0 and st.bytes_per_token["lm"] == st.bytes["lm"] / st.tokens
    ids = archive.tokens(r.session_id)
    restored = archive.restore(r.session_id, at=len(ids) - 1, mode="decode")
    assert restored.mode == "decode" and restored.position == len(ids) - 1
    np.testing.assert_array_equal(restored.tokens, ids[:-1])
    assert_cache_matches_prefill(restored, ids)


def test_turn_by_turn_chat_chains_lm_payloads_across_nodes(archive):
    first = archive.ingest(messages=TURN1, keep=ALL, name="one")[0]
    second = archive.ingest(messages=TURN2, keep=ALL, name="two")[0]
    assert archive.stats().stored_tokens == second.n_tokens  # the first turn is stored once
    for r in (first, second):
        ids = archive.tokens(r.session_id)
        restored = archive.restore(r.session_id, mode="decode")
        np.testing.assert_array_equal(restored.tokens, ids)


def test_splitting_a_node_recodes_both_halves(archive):
    a = archive.ingest(text="The same opening line, then the first ending.", keep=ALL, name="a")[0]
    b = archive.ingest(text="The same opening line, then another ending!", keep=ALL, name="b")[0]  # cuts a's node
    for r in (a, b):
        np.testing.assert_array_equal(archive.restore(r.session_id, mode="decode").tokens, archive.tokens(r.session_id))


class StepCounter:
    """Counts the tokens tier L runs through the model (encoding, decoding and contexts alike)."""

    def __init__(self, monkeypatch):
        self.tokens = 0
        advance = lmcode._advance

        def counted(model, ctx, ids, *args, **kwargs):
            self.tokens += len(ids)
            return advance(model, ctx, ids, *args, **kwargs)

        monkeypatch.setattr(lmcode, "_advance", counted)


ESSAY = "An essay held in tier L alone: every token of it costs a model step to read back. " * 4


def test_reading_the_start_of_a_tier_l_session_decodes_only_that_start(archive, monkeypatch):
    [r] = archive.ingest(text=ESSAY, keep="lm", name="essay")
    assert r.n_tokens > 300
    steps = StepCounter(monkeypatch)
    assert archive.text("essay", 0, 10) == ESSAY[:10]  # one byte a token
    assert steps.tokens == 10
    assert archive.text("essay", 2, 6) == ESSAY[2:6] and steps.tokens == 10  # kept
    restored = archive.restore("essay", at=30, mode="decode")
    assert steps.tokens == 10 + 30 and restored.position == 30
    ids = archive.tokens("essay")  # the whole session: decoded, and checked against its node's id
    assert steps.tokens == 40 + r.n_tokens and archive.text("essay") == ESSAY
    np.testing.assert_array_equal(restored.tokens, ids[:30])
    assert_cache_matches_prefill(restored, ids)


def test_a_new_session_sharing_a_few_tokens_of_a_tier_l_node_leaves_it_whole(archive, monkeypatch):
    a = archive.ingest(text=ESSAY, keep="lm", name="essay")[0]
    b_text = ESSAY[: trie.MIN_SPLIT - 1] + "?! something else entirely"
    steps = StepCounter(monkeypatch)
    b = archive.ingest(text=b_text, name="b")[0]
    assert (
        steps.tokens == 0
    )  # the essay's node is keyed by its first MIN_SPLIT tokens: the walk does not even look it up to decode
    assert b.new_tokens == b.n_tokens and archive.stats().nodes == 2  # stored beside the essay, which is not cut
    assert [n.n_tokens for n in storage_of(archive).node_path(a.session_id)] == [a.n_tokens]
    assert archive.text("b") == b_text and archive.text("essay") == ESSAY
    c = archive.ingest(text=b_text + " and more", keep=ALL, name="c")[
        0
    ]  # sharing all of b: the trie finds b among two first-token kids
    assert c.new_tokens == len(" and more") and archive.verify(deep=True).ok


def test_a_session_cutting_a_tier_l_only_node_decodes_it_once(archive, monkeypatch):
    archive.ingest(text=ESSAY, keep="lm", name="essay")
    decoded = []  # the tokens of every tier-L node decode
    decode = lmcode.decode_node
    monkeypatch.setattr(
        lmcode, "decode_node", lambda *a, **kw: (out := decode(*a, **kw), decoded.append(len(out[0])))[0]
    )
    archive.ingest(
        text=ESSAY[:40] + "a turn of its own", name="c"
    )  # shares 40 tokens: the match goes on to decode the node the cut needs
    assert decoded == [len(ESSAY)]
    assert (
        archive.text("c") == ESSAY[:40] + "a turn of its own"
        and archive.text("essay") == ESSAY
        and archive.stats().nodes == 3
    )


def test_a_new_session_sharing_a_few_tokens_of_a_node_with_tier_l_does_not_recode_it(archive, monkeypatch):
    archive.ingest(text=ESSAY, keep=ALL, name="essay")
    coded = []  # the length of every stretch tier L codes
    encode = lmcode.encode_node
    monkeypatch.setattr(
        lmcode, "encode_node", lambda model, ids, **kw: coded.append(len(ids)) or encode(model, ids, **kw)
    )
    b = archive.ingest(text="An other text", keep=ALL, name="b")[0]  # shares "An " only
    assert coded == [b.n_tokens] and archive.stats().nodes == 2
    np.testing.assert_array_equal(archive.restore("b", mode="decode").tokens, archive.tokens("b"))
    coded.clear()
    archive.ingest(text=ESSAY[:40] + "a turn of its own", keep=ALL, name="c")  # shares 40 tokens: worth a cut
    assert sorted(coded) == sorted([40, len(ESSAY) - 40, len("a turn of its own")])  # both halves, then c's own node
    for name, text in (("essay", ESSAY), ("b", "An other text"), ("c", ESSAY[:40] + "a turn of its own")):
        assert archive.text(name) == text
        np.testing.assert_array_equal(archive.restore(name, mode="decode").tokens, archive.tokens(name))


def test_compact_drops_tiers_and_reads_keep_working(archive):
    [r] = archive.ingest(text="compact me: harbour lights at dusk", keep=ALL, name="c")
    assert [h.name for h in archive.search("harbour lights", k=3) if h.exact] == ["c"]
    archive.compact("c", "tokens,lm")
    assert archive.search("harbour lights", k=3) == []
    assert archive.text("c") == "compact me: harbour lights at dusk"
    np.testing.assert_array_equal(archive.restore("c", mode="decode").tokens, archive.tokens("c"))
    archive.compact("c", "tokens")
    assert archive.stats().bytes["lm"] == 0
    with pytest.raises(InvalidArgument, match="no tier L"):
        archive.restore("c", mode="decode")
    assert_cache_matches_prefill(archive.restore("c", at=5), archive.tokens("c"))
    archive.rebuild_index()  # a rebuild leaves compacted nodes out too
    assert archive.search("harbour lights", k=3) == []


def test_default_keep_has_no_lm_and_bad_lists_are_refused(archive):
    archive.ingest(text="default tiers")
    assert archive.stats().bytes["lm"] == 0
    with pytest.raises(InvalidArgument, match="unknown tier"):
        archive.ingest(text="x", keep="tokens,telepathy")
    with pytest.raises(InvalidArgument, match="keep `tokens` or `lm`"):
        archive.ingest(text="x", keep="search,kv")
    with pytest.raises(InvalidArgument, match="search tier needs the token tier"):
        archive.ingest(text="x", keep="lm,search")
    with pytest.raises(InvalidArgument, match="restore mode"):
        archive.restore(archive.sessions()[0].session_id, mode="psychic")


def test_cli_keep_mode_and_compact(tmp_path, tiny_model):
    write(tmp_path / "s.txt", "a short story about tiers\n")
    runner = CliRunner()
    base = ["--db", str(tmp_path / "c.duckdb")]
    env = {"KVDB_MODEL": tiny_model}
    assert runner.invoke(main, [*base, "ingest", str(tmp_path / "s.txt"), "--keep", ALL], env=env).exit_code == 0
    out = runner.invoke(main, [*base, "restore", "s", "--mode", "decode", "--max-new-tokens", "2", "--json"], env=env)
    assert out.exit_code == 0 and json.loads(out.stdout)["mode"] == "decode"
    stats = json.loads(runner.invoke(main, [*base, "stats", "--json"], env=env).stdout)
    assert stats["bytes"]["lm"] > 0 and "lm" in stats["bytes_per_token"]
    compacted = runner.invoke(main, [*base, "compact", "s", "--keep", "tokens", "--json"], env=env)
    assert compacted.exit_code == 0 and json.loads(compacted.stdout)["status"] == "compacted"
    refused = runner.invoke(main, [*base, "restore", "s", "--mode", "decode"], env=env)
    assert refused.exit_code == 2 and "no tier L" in refused.stderr
    bad = runner.invoke(main, [*base, "ingest", str(tmp_path / "s.txt"), "--keep", "search"], env=env)
    assert bad.exit_code == 2 and "keep `tokens` or `lm`" in bad.stderr


def test_a_damaged_node_payload_is_caught_by_the_node_id_and_an_old_framed_one_still_reads(tmp_path, tiny_model):
    """A node payload has no digest or CRC of its own: the node id, a hash of the path's tokens,
    checks what it decodes to. Payloads written before node payloads ("KL" framed) still read."""
    import duckdb

    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as archive:
        [r] = archive.ingest(
            text="A session whose tokens live in tier L alone, one flipped bit from lost.", keep="lm", name="l"
        )
        ids = archive.tokens("l")
        loaded = archive._models.get()
    con = duckdb.connect(str(path))
    [(node_id, payload)] = con.execute("select node_id, payload from node_lm").fetchall()
    assert lmcode.is_node_payload(payload) and len(payload) < 8 + len(ids)  # a tag byte, then about 8 bits a token here
    framed = lmcode.encode(loaded.model, ids, version=lmcode.payload_version(payload))  # what an older kvdb stored
    middle = len(payload) // 2  # a flipped bit there changes every token after it (the last byte has slack)
    con.execute(
        "update node_lm set payload = ?", [payload[:middle] + bytes([payload[middle] ^ 0x10]) + payload[middle + 1 :]]
    )
    con.close()
    with kvdb.open(path, model=tiny_model) as archive:
        with pytest.raises(kvdb.errors.CorruptData, match="does not hash"):
            archive.restore("l", mode="decode")
    con = duckdb.connect(str(path))
    con.execute("update node_lm set payload = ?", [framed])
    con.close()
    with kvdb.open(path, model=tiny_model) as archive:
        np.testing.assert_array_equal(archive.restore("l", mode="decode").tokens, ids)
        np.testing.assert_array_equal(archive.tokens(r.session_id), ids)


def test_compact_to_tier_l_alone_recodes_a_payload_only_its_machine_can_read(tmp_path, tiny_model):
    """A session archived with a version-2 "KL" payload (what kvdb wrote before version 3) and its
    tokens: compacting it to tier L alone re-codes the payload as a version-3 node payload first,
    since version 2 decodes only where torch computes its square roots alike."""
    import duckdb

    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as archive:
        [r] = archive.ingest(
            text="Archived before version 3, then compacted to its tier L alone.", keep="tokens,lm", name="old"
        )
        ids = archive.tokens("old")
        old = lmcode.encode(archive._models.get().model, ids, version=2)
    con = duckdb.connect(str(path))
    con.execute("update node_lm set payload = ?", [old])
    con.close()
    with kvdb.open(path, model=tiny_model) as archive:
        store = storage_of(archive)
        [node] = store.node_path(r.session_id)
        archive.compact("old", "lm")
        payload = store.node_lm_payload(node.node_id)
        assert lmcode.is_node_payload(payload) and lmcode.payload_version(payload) == 3 and len(payload) < len(old)
        assert store.node_path(r.session_id)[0].keep == {"lm"}
        np.testing.assert_array_equal(archive.restore("old", mode="decode").tokens, ids)
        archive.compact("old", "lm")  # nothing left to re-code
        assert store.node_lm_payload(node.node_id) == payload


def test_tokens_held_in_tier_l_alone_still_read_restore_and_grow(tmp_path, tiny_model):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as first:
        one = first.ingest(messages=TURN1, keep=ALL, name="one")[0]
        text, ids, logprobs = first.text("one"), first.tokens("one"), first.logprobs("one")
        token_bytes = first.stats().bytes["tokens"]
        first.compact("one", "lm")
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_model) as archive:  # nothing decoded before: reads decode tier L
        st = archive.stats()
        assert st.bytes["tokens"] < token_bytes / 4 and st.bytes["lm"] > 0  # only the stream row is left
        assert st.bytes["logprobs"] == 0  # recomputed from the decoded tokens when asked for
        assert archive.text("one") == text
        np.testing.assert_array_equal(archive.tokens("one"), ids)
        restored = archive.restore("one")
        assert restored.mode == "decode"
        np.testing.assert_array_equal(restored.tokens, ids)
        assert [h for h in archive.search("strawberry") if h.exact] == []
        np.testing.assert_allclose(archive.logprobs("one"), logprobs, atol=1e-4)
        report = archive.verify(deep=True)
        assert report.ok and report.checked["sessions held in tier L (framing checked, not decoded)"] == 1

        two = archive.ingest(messages=TURN2, keep=ALL, name="two")[0]  # grows "one": its node is shared now
        assert archive.stats().stored_tokens == two.n_tokens
        assert all("tokens" in n.keep for n in storage_of(archive).node_path(two.session_id))
        for r, messages in ((one, TURN1), (two, TURN2)):  # noqa: B007 - each result beside the turns it stored
            assert archive.text(r.session_id) == archive.text(r.session_id, 0, r.n_tokens)
        assert archive.text("one") == text and [h.name for h in archive.search("banana") if h.exact] == ["two"]
        np.testing.assert_allclose(
            archive.logprobs("two")[: one.n_tokens], logprobs, atol=1e-4
        )  # scored back at the ingest
        assert archive.prefix_bits("one", "two") == pytest.approx(-archive.logprobs("one").sum() / np.log(2), rel=1e-5)
        assert archive.verify(deep=True).ok


def test_a_session_diverging_inside_a_tier_l_node_splits_it(archive):
    a = archive.ingest(text="The same opening line, then the first ending.", keep="lm", name="a")[0]
    assert archive.stats().bytes["tokens"] < 50
    b = archive.ingest(text="The same opening line, then another ending!", name="b")[0]
    assert archive.text("a") == "The same opening line, then the first ending."
    assert archive.text("b") == "The same opening line, then another ending!"
    assert archive.stats().stored_tokens < a.n_tokens + b.n_tokens
    np.testing.assert_array_equal(archive.restore("a", mode="decode").tokens, archive.tokens("a"))
    assert archive.verify(deep=True).ok


def test_dropping_tokens_needs_tier_l_and_keeps_shared_nodes(archive):
    archive.ingest(text="no tier L here", name="plain")
    with pytest.raises(InvalidArgument, match="no tier L on tokens"):
        archive.compact("plain", "lm")
    shared = "A shared preamble that both sessions open with. "
    archive.ingest(text=shared + "First.", keep=ALL, name="x")
    archive.ingest(text=shared + "Second.", keep=ALL, name="y")
    archive.compact("x", "lm")
    path = storage_of(archive).node_path(archive.session("x").session_id)
    assert ["tokens" in n.keep for n in path] == [True, False]  # the shared head keeps its tokens
    assert archive.text("y") == shared + "Second." and [h.name for h in archive.search("Second") if h.exact] == ["y"]
    archive.compact("x", "tokens,lm")  # keeping tokens again decodes them back
    assert all("tokens" in n.keep for n in storage_of(archive).node_path(archive.session("x").session_id))
    assert archive.text("x") == shared + "First." and archive.verify(deep=True).ok


# tiers added to archived sessions -----------------------------------------------------------


def test_ingesting_an_archived_session_again_adds_the_tiers_its_path_lacks(archive, monkeypatch):
    shared = "A preamble that both sessions open with, stored once in the trie. "
    a = archive.ingest(text=shared + "Then the first ending.", keep="tokens", name="a")[0]
    b = archive.ingest(text=shared + "Then another ending!", keep="tokens", name="b")[0]
    assert archive.search("another ending") == []
    coded = []  # the length of every stretch tier L codes
    encode = lmcode.encode_node
    monkeypatch.setattr(
        lmcode, "encode_node", lambda model, ids, **kw: coded.append(len(ids)) or encode(model, ids, **kw)
    )
    [again] = archive.ingest(text=shared + "Then the first ending.", keep=ALL)
    assert (again.status, again.added, again.new_tokens) == ("updated", ("search", "lm"), 0)
    assert again.to_dict()["added"] == ["search", "lm"] and "new_tokens" not in again.to_dict()
    head, tail_b = storage_of(archive).node_path(b.session_id)
    assert coded == [
        n.n_tokens for n in storage_of(archive).node_path(a.session_id)
    ]  # the shared head, then a's own node
    coded.clear()
    assert archive.ingest(text=shared + "Then another ending!", keep=ALL)[0].added == ("search", "lm")
    assert coded == [tail_b.n_tokens]  # the shared head holds tier L already: not coded again
    for r in (a, b):
        assert all(n.keep == {"tokens", "search", "lm"} for n in storage_of(archive).node_path(r.session_id))
        np.testing.assert_array_equal(archive.restore(r.session_id, mode="decode").tokens, archive.tokens(r.session_id))
    assert [h.name for h in archive.search("another ending") if h.exact] == ["b"]
    assert [h.name for h in archive.search("preamble", session="a") if h.exact] == ["a"]
    assert [r.status for r in archive.ingest(text=shared + "Then another ending!", keep=ALL)] == ["unchanged"]
    assert archive.verify(deep=True).ok


def test_ingesting_again_after_codebooks_train_adds_tier_k(kv_archive, monkeypatch):
    shared = "An opening line archived before the session wanted tier K. "
    a = kv_archive.ingest(text=shared + "Its first ending.", name="a")[0]
    b = kv_archive.ingest(text=shared + "A second ending!", name="b")[0]
    assert kv_archive.restore("a").mode == "exact"
    quantized = []  # the node ranges tier K codes
    codes = TierK.codes
    monkeypatch.setattr(
        TierK,
        "codes",
        lambda self, loaded, cache, start, end, **kw: (
            quantized.append((start, end)) or codes(self, loaded, cache, start, end, **kw)
        ),
    )
    [again] = kv_archive.ingest(text=shared + "Its first ending.", keep=KV)
    assert (again.status, again.added, again.to_dict()["added"]) == ("updated", ("kv",), ["kv"])
    assert quantized == [(n.start, n.end) for n in storage_of(kv_archive).node_path(a.session_id)]
    quantized.clear()
    [again] = kv_archive.ingest(text=shared + "A second ending!", keep=KV)
    tail_b = storage_of(kv_archive).node_path(b.session_id)[-1]
    assert again.added == ("kv",) and quantized == [(tail_b.start, tail_b.end)]  # the shared head was coded once
    for r in (a, b):
        restored = kv_archive.restore(r.session_id, mode="archive")  # refused were a node without tier K
        assert restored.mode == "archive" and restored.cache.get_seq_length() == r.n_tokens
    assert kv_archive.ingest(text=shared + "Its first ending.", keep=KV)[0].status == "unchanged"
    assert kv_archive.verify(deep=True).ok


def test_tiers_are_added_with_the_file_let_go(kv_archive, monkeypatch):
    """Scoring, tier L and tier K of a long session read nothing from the file: readers and
    writers of other processes get in meanwhile."""
    text = "A session long enough that adding its tiers is long work for the model. " * 4
    [r] = kv_archive.ingest(text=text, keep="lm", name="long")
    held = []  # whether the file was held when each piece of the model's work ended
    compute = kv_archive._ingester._compute
    score, encode, codes = compute._score, lmcode.encode_node, TierK.codes
    note = lambda out: held.append(storage_of(kv_archive).held_for() > 0) or out  # noqa: E731
    monkeypatch.setattr(compute, "_score", lambda *args: note(score(*args)))
    monkeypatch.setattr(lmcode, "encode_node", lambda *args, **kw: note(encode(*args, **kw)))
    monkeypatch.setattr(TierK, "codes", lambda *args, **kw: note(codes(*args, **kw)))
    assert kv_archive.ingest(text=text, keep="tokens,search,kv")[0].added == ("tokens", "search", "kv")
    assert held == [False, False]  # the scoring pass (its cache serves tier K too), then tier K
    assert kv_archive.restore("long", mode="archive").mode == "archive" and r.n_tokens >= 128
    kv_archive.compact("long", "tokens")
    held.clear()
    assert kv_archive.ingest(text=text, keep="tokens,lm")[0].added == ("lm",)
    assert held == [False]


def test_ingesting_again_gives_tokens_back_to_a_session_held_in_tier_l_only(archive):
    text = "Held in tier L alone, then given its tokens and the search tier back."
    [r] = archive.ingest(text=text, keep="lm", name="l")
    logprobs = archive.logprobs("l")
    [again] = archive.ingest(text=text)  # the default tiers: tokens and search now, semantic queued
    assert (again.status, again.added) == ("updated", ("tokens", "search"))
    assert archive.upkeep(only="semantic").embedded.sessions == 1
    assert [n.keep for n in storage_of(archive).node_path(r.session_id)] == [{"tokens", "search", "semantic", "lm"}]
    assert archive.stats().bytes["logprobs"] == 4 * r.n_tokens
    np.testing.assert_allclose(archive.logprobs("l"), logprobs, atol=1e-4)
    assert [h.name for h in archive.search("search tier back") if h.exact] == ["l"]
    assert [h.name for h in archive.search_meaning("given its tokens back")] == ["l"]
    assert archive.restore("l").mode == "exact" and archive.verify(deep=True).ok


# advice in error messages: each is followed literally, and then what failed works ----------------


@pytest.fixture
def cli(tmp_path, tiny_model):
    """``kvdb --db <tmp>/c.duckdb ARGS...`` with the tiny model."""
    runner = CliRunner()
    return lambda *args, env=None: runner.invoke(
        main, ["--db", str(tmp_path / "c.duckdb"), *map(str, args)], env={"KVDB_MODEL": tiny_model, **(env or {})}
    )


def test_advice_no_tier_k_ingest_with_kv_or_restore_exact(tmp_path, cli):
    session = write(tmp_path / "later.txt", "A session archived before any codebooks, restored from tier K after.")
    assert cli("ingest", write(tmp_path / "calibration.txt", CALIBRATION), session).exit_code == 0
    assert cli("codebooks", "train", "--preset", "k2v1", "--tokens", "2000").exit_code == 0
    refused = cli("restore", "later", "--mode", "archive", "--max-new-tokens", 1)
    assert (
        refused.exit_code == 2
        and "ingest it with --keep tokens,search,kv, or restore with --mode exact" in refused.stderr
    )
    assert cli("restore", "later", "--mode", "exact", "--max-new-tokens", 1).exit_code == 0
    updated = cli("ingest", session, "--keep", "tokens,search,kv", "--kv-preset", "k2v1", "--json")
    assert (
        updated.exit_code == 0
        and json.loads(updated.stdout)["status"] == "updated"
        and json.loads(updated.stdout)["added"] == ["kv"]
    )
    restored = cli("restore", "later", "--mode", "archive", "--max-new-tokens", 1, "--json")
    assert restored.exit_code == 0 and json.loads(restored.stdout)["mode"] == "archive"


def test_kv_on_a_fresh_archive_uses_the_shipped_codebooks_until_some_are_trained(tmp_path, cli):
    session = write(tmp_path / "later.txt", "A session that wants its quantized KV cache archived.")
    ingested = cli("ingest", session, "--keep", KV, "--json")
    assert ingested.exit_code == 0 and json.loads(ingested.stdout)["status"] == "ingested"
    auto = json.loads(
        cli("restore", "later", "--max-new-tokens", 1, "--json").stdout
    )  # nobody measured the tiny model's presets
    assert auto["mode"] == "exact" and "balanced (k6v4) has no measured fidelity" in auto["reason"]
    assert (
        json.loads(cli("restore", "later", "--mode", "archive", "--max-new-tokens", 1, "--json").stdout)["mode"]
        == "archive"
    )
    [shipped] = [json.loads(line) for line in cli("codebooks", "list", "--json").stdout.splitlines()]
    assert (
        shipped["source"] == "shipped"
        and shipped["on_this_machine"]
        and shipped["stored_bytes"] < 1024 < shipped["centroid_bytes"]
    )
    stats = json.loads(cli("stats", "--json").stdout)
    assert (
        stats["codebook_bytes"] == shipped["stored_bytes"]
        and stats["shipped_codebook_bytes"] == shipped["centroid_bytes"]
    )
    assert cli("ingest", write(tmp_path / "calibration.txt", CALIBRATION)).exit_code == 0
    assert cli("codebooks", "train", "--preset", "k2v1", "--tokens", "2000").exit_code == 0
    listed = [json.loads(line) for line in cli("codebooks", "list", "--json").stdout.splitlines()]
    assert [c["source"] for c in listed] == ["shipped", "trained"] and listed[1]["preset"] == "k2v1"
    next_text = write(tmp_path / "next.txt", "A later session, coded with the trained set.")
    assert cli("ingest", next_text, "--keep", KV, "--kv-preset", "k2v1").exit_code == 0
    restored = {
        name: json.loads(cli("restore", name, "--mode", "archive", "--max-new-tokens", 1, "--json").stdout)
        for name in ("next", "later")
    }
    assert {
        name: (r["mode"], r["preset_fidelity"]["spec"], r["preset_fidelity"]["source"]) for name, r in restored.items()
    } == {
        "next": ("archive", "k2v1", "trained"),
        "later": ("archive", "k6v4", "shipped"),  # still the shipped set it was coded with
    }
    assert json.loads(cli("stats", "--json").stdout)["kv_bytes_by_preset"].keys() == {"balanced", "k2v1"}


@pytest.mark.slow
def test_advice_too_few_positions_archive_more_or_pass_tokens(tmp_path, cli):
    assert cli("ingest", write(tmp_path / "short.txt", "Too short to train codebooks on.")).exit_code == 0
    refused = cli("codebooks", "train", "--preset", "k2v1")
    assert (
        refused.exit_code == 2
        and "archive more sessions first, then run `kvdb codebooks train` again" in refused.stderr
    )
    assert cli("ingest", write(tmp_path / "calibration.txt", CALIBRATION)).exit_code == 0
    assert cli("codebooks", "train", "--preset", "k2v1").exit_code == 0
    assert (
        cli("ingest", write(tmp_path / "more.txt", CALIBRATION.replace("a", "o"))).exit_code == 0
    )  # enough for 1024 centroids
    capped = cli("codebooks", "train", "--preset", "k1x1024v1x1024", "--tokens", 256)
    assert capped.exit_code == 2 and "pass --tokens 1024 or more" in capped.stderr
    trained = cli("codebooks", "train", "--preset", "k1x1024v1x1024", "--tokens", 1024, "--json")
    assert trained.exit_code == 0 and json.loads(trained.stdout)["tokens"] >= 1024


def test_advice_no_tier_l_ingest_with_lm_or_restore_exact(tmp_path, cli):
    session = write(tmp_path / "s.txt", "A session archived without tier L, decoded from it later.")
    assert cli("ingest", session).exit_code == 0
    refused = cli("restore", "s", "--mode", "decode", "--max-new-tokens", 1)
    assert (
        refused.exit_code == 2
        and "ingest it with --keep tokens,search,lm, or restore with --mode exact" in refused.stderr
    )
    assert cli("restore", "s", "--mode", "exact", "--max-new-tokens", 1).exit_code == 0
    updated = cli("ingest", session, "--keep", "tokens,search,lm", "--json")
    assert updated.exit_code == 0 and json.loads(updated.stdout)["added"] == ["lm"]
    restored = cli("restore", "s", "--mode", "decode", "--max-new-tokens", 1, "--json")
    assert restored.exit_code == 0 and json.loads(restored.stdout)["mode"] == "decode"


def test_advice_compact_reingest_with_lm_first(tmp_path, cli):
    text = "A session whose token tier is dropped, once tier L holds its tokens."
    session = write(tmp_path / "s.txt", text)
    assert cli("ingest", session).exit_code == 0
    refused = cli("compact", "s", "--keep", "lm")
    assert refused.exit_code == 2 and "re-ingest it with --keep tokens,search,lm first" in refused.stderr
    updated = cli("ingest", session, "--keep", "tokens,search,lm")
    assert updated.exit_code == 0 and updated.stdout.startswith("updated ") and "(added lm, " in updated.stdout
    assert cli("compact", "s", "--keep", "lm").exit_code == 0
    assert cli("show", "s").stdout == text and json.loads(cli("stats", "--json").stdout)["bytes"]["logprobs"] == 0


def test_advice_model_mismatch_pass_the_archived_model(tmp_path, cli, other_tiny_model):
    assert cli("ingest", write(tmp_path / "s.txt", "Archived with one model, restored with another.")).exit_code == 0
    refused = cli("restore", "s", "--model", other_tiny_model, "--max-new-tokens", 1)
    assert refused.exit_code == 4
    [archived] = re.findall(r"pass --model '([^']+)'", refused.stderr)
    assert (
        cli("restore", "s", "--model", archived, "--max-new-tokens", 1, env={"KVDB_MODEL": other_tiny_model}).exit_code
        == 0
    )


def test_advice_read_only_open_without_read_only(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    kvdb.open(path, model=tiny_model).close()
    with (
        kvdb.open(path, model=tiny_model, read_only=True) as db,
        pytest.raises(ArchiveError, match="open it without read_only=True to change it"),
    ):
        db.ingest(text="written through a read-only archive")
    with kvdb.open(path, model=tiny_model) as db:
        assert db.ingest(text="written through a read-only archive")[0].status == "ingested"


def test_advice_empty_archive_ingest_first(tmp_path, cli, tiny_model):
    kvdb.open(tmp_path / "c.duckdb", model=tiny_model).close()
    refused = cli("search", "harbour")
    assert refused.exit_code == 1 and "ingest transcripts first with `kvdb ingest PATH`" in refused.stderr
    assert cli("ingest", write(tmp_path / "s.txt", "The harbour lights at dusk.")).exit_code == 0
    found = cli("search", "harbour", "--json")
    assert found.exit_code == 0 and json.loads(found.stdout.splitlines()[0])["name"] == "s"


@pytest.mark.parametrize("command", ["repair", "gc"])
def test_advice_prefix_cache_entry_never_resumed_repair_or_gc(tmp_path, cli, tiny_model, command):
    with kvdb.open(tmp_path / "c.duckdb", model=tiny_model) as db:
        one = db.ingest(messages=TURN1)[0]
        two = db.ingest(messages=TURN2)[0]  # grows the first
        db.upkeep()  # newest first: the second's pass scores the first's path too, and only its cache is kept
    [entry] = (tmp_path / "c.duckdb.prefix").iterdir()
    assert entry.name == f"{two.session_id}.kv"
    entry.rename(entry.with_name(f"{one.session_id}.kv"))  # an entry that holds more positions than its path
    refused = cli("verify")
    assert refused.exit_code == 1 and "(run `kvdb repair` or `kvdb gc` to delete it)" in refused.stdout
    assert cli(command).exit_code == 0
    assert cli("verify").exit_code == 0


@pytest.mark.parametrize(
    "damage, command", [("missing", ["repair"]), ("missing", ["index", "rebuild"]), ("damaged", ["repair"])]
)
def test_advice_search_index_file_repair_or_rebuild(tmp_path, cli, tiny_model, damage, command):
    path = tmp_path / "c.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="The harbour lights at dusk.", name="s")
        assert db.search("harbour")  # the index is loaded; its file is then lost or damaged under this process
        sidecars = sorted(
            (tmp_path / "c.duckdb.index").iterdir(), key=lambda f: f.stat().st_size
        )  # the base and its tail
        if damage == "missing":
            for sidecar in sidecars:
                sidecar.unlink()
        else:
            # a token of the larger (the session's tokens are in the tail);
            # not the file's last byte, padding when a later array is empty
            data = bytearray(sidecars[-1].read_bytes())
            length = int.from_bytes(data[8:12], "little")  # the header's (docs/formats.md, "Sidecar files")
            tokens = json.loads(data[12 : 12 + length])["arrays"]["tokens"]
            data[
                -(-(12 + length) // 64) * 64
                + tokens["offset"]
                + np.dtype(tokens["dtype"]).itemsize * tokens["shape"][0]
                - 1
            ] ^= 0x01
            sidecars[-1].write_bytes(bytes(data))
        problems = db.verify().problems
    advice = "(run `kvdb repair` or `kvdb index rebuild`)" if damage == "missing" else "(run `kvdb repair`)"
    assert any(p.endswith(advice) for p in problems), problems
    assert cli(*command).exit_code == 0
    with kvdb.open(path, model=tiny_model) as db:
        report = db.verify()
        assert report.ok and report.notes == []  # the command mended it: verify had nothing to rebuild
        assert [h.name for h in db.search("harbour") if h.exact] == ["s"]


def test_a_session_past_the_context_ingests_in_parts_each_reported(tmp_path, cli):
    text = "".join(
        f"Line {i} of a long transcript.\n" for i in range(200)
    )  # 5,000+ tokens of the byte-level tiny model
    parts = cli("ingest", write(tmp_path / "long.txt", text), "--json")
    rows = [json.loads(line) for line in parts.stdout.splitlines()]
    assert (
        parts.exit_code == 0
        and [(r["status"], r["part"]) for r in rows] == [("ingested", n) for n in range(1, len(rows) + 1)]
        and len(rows) > 1
    )
    again = cli("ingest", tmp_path / "long.txt")
    assert again.exit_code == 0 and [line.split()[0] for line in again.stdout.splitlines()] == ["unchanged"] * len(rows)
    assert "long (part 2)" in again.stdout


def test_advice_unsupported_file_type_use_a_supported_one(tmp_path, cli):
    refused = cli("ingest", write(tmp_path / "notes.log", "plain text in a .log file"), "--json")
    supported = re.search(r"supported: (\S+)", json.loads(refused.stdout)["error"])[1].split(",")[0]
    assert refused.exit_code == 1 and supported == ".txt"
    assert cli("ingest", write(tmp_path / f"notes{supported}", "plain text in a .log file")).exit_code == 0


def test_advice_unknown_session_list_them_or_give_one_of_the_matches(tmp_path, cli):
    for folder in ("a", "b"):
        assert cli("ingest", write(tmp_path / folder / "notes.txt", f"notes kept in folder {folder}")).exit_code == 0
    refused = cli("show", "nonesuch")
    assert refused.exit_code == 3 and "list them with `kvdb sessions`" in refused.stderr
    listed = [json.loads(line) for line in cli("sessions", "--json").stdout.splitlines()]
    assert cli("show", listed[0]["session_id"]).stdout == "notes kept in folder a"
    ambiguous = cli("show", "notes")
    assert ambiguous.exit_code == 3 and "give one of these, or an id" in ambiguous.stderr
    second = re.findall(r"(notes#\d) \(", ambiguous.stderr)[1]
    assert cli("show", second).stdout == "notes kept in folder b"
    past = cli("show", "notes#3")
    assert past.exit_code == 3 and past.stderr.rstrip().endswith("notes#1 to notes#2")
    assert cli("show", "notes#2").stdout == "notes kept in folder b"


@pytest.mark.slow
def test_advice_archive_in_use_raise_lock_timeout_or_retry(tmp_path, tiny_model, monkeypatch):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="an archive another process is writing")
    hold = (
        f"from kvdb.storage import open_storage; s = open_storage({str(path)!r}); s.list_sessions(); "
        "print('ready', flush=True); import time; time.sleep(3)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        monkeypatch.setenv("KVDB_LOCK_TIMEOUT", "0.2")
        with pytest.raises(ArchiveLocked, match="retry when it is done, or raise KVDB_LOCK_TIMEOUT"):
            kvdb.open(path, read_only=True).sessions()
        monkeypatch.setenv("KVDB_LOCK_TIMEOUT", "60")  # raised: this open waits for the writer to finish
        with kvdb.open(path, read_only=True) as db:
            assert len(db.sessions()) == 1
    finally:
        holder.wait(timeout=60)
    monkeypatch.setenv("KVDB_LOCK_TIMEOUT", "0.2")  # retried once the writer is done
    with kvdb.open(path, read_only=True) as db:
        assert len(db.sessions()) == 1


def test_advice_internal_error_rerun_with_kvdb_debug(tmp_path, cli, tiny_model, monkeypatch):
    kvdb.open(tmp_path / "c.duckdb", model=tiny_model).close()
    monkeypatch.setattr(kvdb.Archive, "stats", lambda self: {}["no such key"])
    failed = cli("stats")
    assert failed.exit_code == 70 and "(rerun with KVDB_DEBUG=1 for the traceback)" in failed.stderr
    debug = cli("stats", env={"KVDB_DEBUG": "1"})
    assert isinstance(debug.exception, KeyError) and debug.exc_info[2] is not None  # the traceback, for a bug report


def test_advice_unknown_model_give_a_local_folder(tmp_path, cli, tiny_model):
    session = write(tmp_path / "s.txt", "archived with a model given by its folder")
    refused = cli("ingest", session, "--model", tmp_path / "no-such-model")
    assert refused.exit_code == 4 and "give a local model folder" in refused.stderr
    assert cli("ingest", session, "--model", tiny_model).exit_code == 0


@pytest.mark.slow
def test_advice_unknown_model_give_a_hugging_face_id_in_the_local_cache(tmp_path, tiny_model):
    """A model id resolves, offline, from the Hugging Face cache: a process of its own, since the
    hub reads where its cache is once, at import."""
    repo = tmp_path / "hub" / "models--kvdb-tests--tiny"
    shutil.copytree(tiny_model, repo / "snapshots" / ("0" * 40))
    write(repo / "refs" / "main", "0" * 40)
    session = write(tmp_path / "s.txt", "archived with a model found in the Hugging Face cache")
    command = [
        sys.executable,
        "-c",
        "from kvdb.cli.main import main; main()",
        "--db",
        str(tmp_path / "c.duckdb"),
        "ingest",
        str(session),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    refused = subprocess.run([*command, "--model", "kvdb-tests/tiny"], env=env, capture_output=True, text=True)
    assert refused.returncode == 4 and "a Hugging Face id already in the local cache" in refused.stderr
    found = subprocess.run(
        [*command, "--model", "kvdb-tests/tiny"],
        env=dict(env, HF_HUB_CACHE=str(tmp_path / "hub")),
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr


@pytest.mark.model
def test_advice_unknown_model_omit_model_for_the_embedded_default(tmp_path, cli):
    session = write(tmp_path / "s.txt", "archived with the embedded default model")
    refused = cli("ingest", session, "--model", "kvdb-tests/not-in-any-cache", env={"KVDB_MODEL": None})
    assert refused.exit_code == 4 and "or omit --model for the embedded default" in refused.stderr
    assert cli("ingest", session, env={"KVDB_MODEL": None}).exit_code == 0


def test_advice_nothing_to_continue_from_restore_later_or_give_a_prompt(archive):
    archive.ingest(text="A session continued from its very start.", name="s")
    with pytest.raises(InvalidArgument, match="restore at a position > 0 or give a prompt"):
        archive.continue_session("s", at=0, max_new_tokens=2)
    assert isinstance(archive.continue_session("s", at=5, max_new_tokens=2), str)
    assert isinstance(archive.continue_session("s", prompt="Go on", at=0, max_new_tokens=2), str)


def test_advice_fidelity_probe_needs_more_tokens_up_to_at(kv_archive):
    kv_archive.ingest(text="A session whose archive restore is measured near its start.", keep=KV, name="s")
    with pytest.raises(InvalidArgument, match="needs at least 7 tokens up to --at") as refused:
        kv_archive.fidelity("s", at=6)
    needed = int(re.search(r"at least (\d+) tokens", str(refused.value))[1])
    assert kv_archive.fidelity("s", at=needed).probe_tokens == needed - capture.SINKS - 1
