"""Tier policy: --keep at ingest, tier L coded per trie node, restore from tier L alone, compact."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import kvdb
from kvdb.errors import InvalidArgument
from kvdb_cli.main import main

from support import storage_of, write

ALL = "tokens,search,lm"
TURN1 = [{"role": "user", "content": "Name a red fruit."}, {"role": "assistant", "content": "A strawberry."}]
TURN2 = TURN1 + [{"role": "user", "content": "And a yellow one?"}, {"role": "assistant", "content": "A banana."}]


def assert_cache_matches_prefill(restored, ids):
    """The restored cache continues the session as a fresh prefill of the same tokens would."""
    with torch.no_grad():
        step = restored.model(torch.as_tensor(ids[restored.position :][:1])[None], past_key_values=restored.cache).logits[0, -1]
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
        assert report.ok and report.checked["sessions held in tier L (headers checked, not decoded)"] == 1

        two = archive.ingest(messages=TURN2, keep=ALL, name="two")[0]  # grows "one": its node is shared now
        assert archive.stats().stored_tokens == two.n_tokens
        assert all("tokens" in n.keep for n in storage_of(archive).node_path(two.session_id))
        for r, messages in ((one, TURN1), (two, TURN2)):
            assert archive.text(r.session_id) == archive.text(r.session_id, 0, r.n_tokens)
        assert archive.text("one") == text and [h.name for h in archive.search("banana") if h.exact] == ["two"]
        np.testing.assert_allclose(archive.logprobs("two")[: one.n_tokens], logprobs, atol=1e-4)  # scored back at the ingest
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
