"""Tier policy: --keep at ingest, tier L coded per trie node, restore from tier L alone, compact."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvdb.errors import InvalidArgument
from kvdb_cli.main import main

from conftest import write

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
    with pytest.raises(InvalidArgument, match="always kept"):
        archive.ingest(text="x", keep="search")
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
    bad = runner.invoke(main, [*base, "ingest", str(tmp_path / "s.txt"), "--keep", "lm"], env=env)
    assert bad.exit_code == 2 and "always kept" in bad.stderr
