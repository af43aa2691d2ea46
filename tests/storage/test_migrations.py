"""Archives written by older schemas open, and their data survives every migration."""

import json

import numpy as np
import sqlalchemy as sa
from alembic import command

from kvdb.storage import open_storage
from kvdb.storage.migrate import script_directory


def migrate(path, revision, direction=command.upgrade):
    engine = sa.create_engine(f"duckdb:///{path}")
    _, config = script_directory()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        direction(config, revision)
    engine.dispose()


def write_v0001_archive(path, sessions):
    """An archive as the Foundation release (schema 0001) wrote it: raw int32 ids per session."""
    migrate(path, "0001")
    engine = sa.create_engine(f"duckdb:///{path}")
    with engine.begin() as conn:
        conn.execute(
            sa.text("insert into models values ('m1', 'tiny', 'w', 't', :c, now())"),
            {"c": json.dumps({"vocab_size": 300})},
        )
        for sid, ids, logprobs in sessions:
            conn.execute(
                sa.text("insert into sessions values (:s, :s, 'src', 'm1', now(), :n, '{}')"), {"s": sid, "n": len(ids)}
            )
            conn.execute(
                sa.text("insert into session_tokens values (:s, :t, :l)"),
                {"s": sid, "t": ids.astype("<i4").tobytes(), "l": logprobs.astype("<f4").tobytes()},
            )
    engine.dispose()


def test_0001_archive_moves_to_fractal_blocks(tmp_path):
    rng = np.random.default_rng(0)
    sessions = [
        (f"s{i}", rng.integers(0, 300, size=n), rng.normal(size=n).astype(np.float32))
        for i, n in enumerate([1, 5000, 9000])  # one block, one full block plus a partial, several blocks
    ]
    path = tmp_path / "old.duckdb"
    write_v0001_archive(path, sessions)

    store = open_storage(path)  # opening upgrades to head
    try:
        assert store.engine.schema_revision() == script_directory()[0].get_current_head()
        for sid, ids, logprobs in sessions:
            np.testing.assert_array_equal(store.load_tokens(sid), ids)
            lo, hi = min(4090, len(ids)), min(4100, len(ids))  # across the first block boundary
            np.testing.assert_array_equal(store.load_tokens(sid, lo, hi), ids[lo:hi])
            np.testing.assert_array_equal(store.load_logprobs(sid), logprobs)
        assert all(
            n.keep == {"search", "tokens"} for n, _, _ in store.node_shapes()
        )  # 0005 and 0007 name the tiers held
        counts = store.byte_counts()
        assert counts["tokens"] == sum(len(ids) for _, ids, _ in sessions)
        assert counts["token_bytes"] < 1.2 * 2 * counts["tokens"]  # fractal blocks, not 4-byte ids
    finally:
        store.close()


def test_downgrade_restores_raw_ids(tmp_path):
    ids = np.arange(7000) % 300
    path = tmp_path / "old.duckdb"
    write_v0001_archive(path, [("s0", ids, np.zeros(len(ids), np.float32))])
    migrate(path, "0003")  # 0004 shares trie nodes between sessions and has no way back
    migrate(path, "0001", command.downgrade)
    engine = sa.create_engine(f"duckdb:///{path}")
    with engine.connect() as conn:
        blob = conn.execute(sa.text("select tokens from session_tokens where session_id = 's0'")).scalar_one()
    engine.dispose()
    np.testing.assert_array_equal(np.frombuffer(blob, "<i4"), ids)
