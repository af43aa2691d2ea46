"""Initial schema: models, sessions, and each session's raw token stream with log-probabilities.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("model_id", sa.String, primary_key=True),
        sa.Column("name", sa.String, nullable=False),
        sa.Column("weights_hash", sa.String, nullable=False),
        sa.Column("tokenizer_hash", sa.String, nullable=False),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("name", sa.String, nullable=False),
        sa.Column("source", sa.String, nullable=False),
        sa.Column("model_id", sa.String, nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("n_tokens", sa.Integer, nullable=False),
        sa.Column("metadata", sa.Text, nullable=False),
    )
    op.create_index("ix_sessions_name", "sessions", ["name"])
    # Raw little-endian int32 token ids and float32 natural-log probabilities, one row per session.
    op.create_table(
        "session_tokens",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("session_tokens")
    op.drop_index("ix_sessions_name", "sessions")
    op.drop_table("sessions")
    op.drop_table("models")
