"""Token streams in the fractal codec: one row per block of anchors, decoded lazily by range.

Moves every session's raw int32 ids (schema 0001) into fractal-coded blocks and its
log-probabilities into a table of their own.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import json

import numpy as np
import sqlalchemy as sa
from alembic import op

from kvdb.migrations import _frozen_0002_fractal as fractal  # frozen: never the live kvdb.codecs.fractal

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "token_streams",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("alphabet", sa.Integer, nullable=False),
        sa.Column("block_size", sa.Integer, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
    )
    op.create_table(
        "token_blocks",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("block_no", sa.Integer, primary_key=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "session_logprobs",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
    )
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "select t.session_id, t.tokens, t.logprobs, m.config from session_tokens t "
            "join sessions s on s.session_id = t.session_id left join models m on m.model_id = s.model_id"
        )
    ).all()
    for session_id, tokens, logprobs, config in rows:
        ids = np.frombuffer(tokens, dtype="<i4").astype(np.int64)
        vocab = (json.loads(config).get("vocab_size") if config else None) or 0
        alphabet = max(vocab, int(ids.max()) + 1 if ids.size else 0, fractal.MIN_ALPHABET)
        blocks = fractal.encode_blocks(ids, alphabet, fractal.DEFAULT_BLOCK)
        conn.execute(
            sa.text("insert into token_streams values (:s, :a, :b, :n)"),
            {"s": session_id, "a": alphabet, "b": fractal.DEFAULT_BLOCK, "n": int(ids.size)},
        )
        for block_no, blob in enumerate(blocks):
            conn.execute(sa.text("insert into token_blocks values (:s, :k, :d)"), {"s": session_id, "k": block_no, "d": blob})
        conn.execute(sa.text("insert into session_logprobs values (:s, :l)"), {"s": session_id, "l": logprobs})
    op.drop_table("session_tokens")


def downgrade() -> None:
    op.create_table(
        "session_tokens",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
    )
    conn = op.get_bind()
    streams = conn.execute(sa.text("select session_id, alphabet from token_streams")).all()
    for session_id, alphabet in streams:
        blobs = conn.execute(
            sa.text("select data from token_blocks where session_id = :s order by block_no"), {"s": session_id}
        ).scalars()
        ids = fractal.decode_blocks(list(blobs), alphabet)
        logprobs = conn.execute(sa.text("select logprobs from session_logprobs where session_id = :s"), {"s": session_id}).scalar_one()
        conn.execute(
            sa.text("insert into session_tokens values (:s, :t, :l)"),
            {"s": session_id, "t": ids.astype("<i4").tobytes(), "l": logprobs},
        )
    op.drop_table("session_logprobs")
    op.drop_table("token_blocks")
    op.drop_table("token_streams")
