"""verify finds damage in one line each and exits non-zero; repair rebuilds what can be derived."""

import json

import duckdb
import pytest
from click.testing import CliRunner

import kvdb
from kvdb.cli.main import main


@pytest.fixture
def archived(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="A shared beginning, then the first ending.", name="one", keep="tokens,search,lm")
        db.ingest(text="A shared beginning, then a second ending.", name="two")
        assert db.search("beginning", k=2)
    return path


def test_a_healthy_archive_verifies(archived, tiny_model):
    with kvdb.open(archived, model=tiny_model) as db:
        for deep in (False, True):
            report = db.verify(deep=deep)
            assert report.ok, report.problems
            assert (
                report.checked["sessions"] == 2
                and report.checked["token blocks"] >= 3
                and report.checked["lm payloads"] >= 1
            )


def test_a_corrupted_token_block_is_caught(archived, tiny_model):
    con = duckdb.connect(str(archived))
    node, block, data = con.execute("select node_id, block_no, data from token_blocks limit 1").fetchone()
    damaged = bytearray(data)
    damaged[10] ^= 0x40
    con.execute("update token_blocks set data = ? where node_id = ? and block_no = ?", [bytes(damaged), node, block])
    con.close()
    with kvdb.open(archived, model=tiny_model) as db:
        report = db.verify(deep=True)
    assert not report.ok
    assert any(f"token block {block} of node {node[:12]}" in p and "CRC" in p for p in report.problems)


def test_broken_refcount_and_stale_index_then_repair(archived, tiny_model):
    con = duckdb.connect(str(archived))
    con.execute("update nodes set refcount = refcount + 5 where parent_id is null")
    con.execute("update search_indexes set generation = generation + 1")
    con.close()
    with kvdb.open(archived, model=tiny_model) as db:
        report = db.verify()
        assert any("counts" in p and "run through it" in p for p in report.problems)
        assert any("disagreed with the database; rebuilt" in n for n in report.notes)  # detected and mended
        assert not any("stale" in p for p in report.problems)
        result = db.repair()
    assert result.rebuilt_indexes and any("run through it" in p for p in result.unrepairable)


def test_cli_verify_exit_codes(archived, tiny_model, tmp_path):
    runner = CliRunner()
    base = ["--db", str(archived)]
    ok = runner.invoke(main, [*base, "verify", "--json"], env={"KVDB_MODEL": tiny_model})
    assert ok.exit_code == 0 and json.loads(ok.stdout)["ok"] is True
    con = duckdb.connect(str(archived))
    con.execute("update node_lm set payload = 'garbage'")
    con.close()
    bad = runner.invoke(main, [*base, "verify", "--deep"], env={"KVDB_MODEL": tiny_model})
    assert bad.exit_code == 1 and "tier L payload" in bad.stdout and "Traceback" not in bad.output


def test_dangling_model_and_codebook_references_are_caught(kv_archive, tmp_path):
    kv_archive.ingest(text="a session with its KV codes", name="kv", keep="tokens,search,kv")
    assert kv_archive.verify().ok
    path = kv_archive.path
    kv_archive.close()
    con = duckdb.connect(str(path))
    con.execute("delete from codebooks")
    con.execute("delete from models")
    con.close()
    with kvdb.open(path, read_only=True) as db:
        problems = db.verify().problems
    assert any(p.startswith("session ") and "names model" in p for p in problems)
    assert any(p.startswith("KV codes of node ") and "names codebooks" in p for p in problems)


def test_kv_streams_short_of_their_positions_are_caught(kv_archive):
    """Each node's tier-K streams must hold n_tokens x columns codes (a sliding-window cache once
    stored only its last window); a block gone from a stream is found by a deep verify."""
    kv_archive.ingest(
        text="a session with its KV codes, long enough to fill more than one block " * 40,
        name="kv",
        keep="tokens,search,kv",
    )
    assert kv_archive.verify(deep=True).ok
    path = kv_archive.path
    kv_archive.close()
    con = duckdb.connect(str(path))
    con.execute("delete from node_kv where block_no = (select max(block_no) from node_kv)")
    con.close()
    with kvdb.open(path, read_only=True) as db:
        assert db.verify().ok  # the sample check reads block headers only
        assert any(
            p.startswith("KV codes of node ") and "symbols per codebook size" in p
            for p in db.verify(deep=True).problems
        )
