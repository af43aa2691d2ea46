"""Semantic search mechanics on the tiny model (quality is measured by benchmarks/semantic.py)."""

import json

import pytest
from click.testing import CliRunner
from kvdb_cli.main import main
from support import CALIBRATION, KV, write

from kvdb.errors import InvalidArgument, TierMissing


def test_semantic_hits_point_at_positions_with_tier_k(kv_archive):
    with pytest.raises(TierMissing, match="--keep tokens,search,kv"):  # nothing stored with tier K yet
        kv_archive.search_semantic("harbour")
    kv_archive.ingest(text="The harbour lights were lit at dusk.", keep=KV, name="harbour")
    kv_archive.ingest(text="Lentils simmer with cumin and onions.", keep=KV, name="kitchen")
    hits = kv_archive.search_semantic("lights at dusk", k=5, context=4, layer=1)
    assert 1 <= len(hits) <= 5
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    for h in hits:
        assert not h.exact and h.similarity is not None and -1.0001 <= h.similarity <= 1.0001
        assert h.match == kvdb_text(kv_archive, h) and h.match in h.context
    with pytest.raises(InvalidArgument, match="layer"):
        kv_archive.search_semantic("x", layer=99)


def kvdb_text(archive, hit):
    return archive.text(hit.session_id, hit.position, hit.position + 1)


def test_cli_semantic(tmp_path, tiny_model):
    write(tmp_path / "calibration.txt", CALIBRATION)
    runner = CliRunner()
    base = ["--db", str(tmp_path / "c.duckdb")]
    env = {"KVDB_MODEL": tiny_model}
    assert runner.invoke(main, [*base, "ingest", str(tmp_path / "calibration.txt")], env=env).exit_code == 0
    assert runner.invoke(main, [*base, "codebooks", "train", "--preset", "k2v1", "--tokens", "2000"], env=env).exit_code == 0
    write(tmp_path / "later.txt", "A later session about harbour lights.")
    assert runner.invoke(main, [*base, "ingest", str(tmp_path / "later.txt"), "--keep", KV], env=env).exit_code == 0
    out = runner.invoke(main, [*base, "search", "harbour", "--semantic", "--layer", "0", "-k", "2", "--json"], env=env)
    assert out.exit_code == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2 and all(not r["exact"] and 0 < r["score"] <= 1.0001 for r in rows)
