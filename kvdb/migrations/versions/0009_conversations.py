"""Conversations: sessions that are states of one conversation (a log that grew, a server's chat
turn after turn, a fork of either) share one conversation id, and a conversation may be renamed.

Sessions stay the storage unit; ``conversation_sessions`` says which conversation each belongs
to. Existing sessions are grouped by the rule of ``_frozen_0009_conversations``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

from kvdb.migrations import _frozen_0009_conversations as frozen

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("conversation_id", sa.String, primary_key=True),
        sa.Column("title", sa.String, nullable=True),
    )
    op.create_table(
        "conversation_sessions",
        sa.Column("session_id", sa.String, primary_key=True),
        sa.Column("conversation_id", sa.String, nullable=False),
    )
    op.create_index("ix_conversation_sessions_conversation", "conversation_sessions", ["conversation_id"])
    conn = op.get_bind()
    sessions = [
        tuple(r) for r in conn.execute(sa.text("select session_id, name, source, created_at from sessions")).fetchall()
    ]
    parents = {r[0]: r[1] for r in conn.execute(sa.text("select node_id, parent_id from nodes")).fetchall()}
    grouped = frozen.groups(sessions, parents)
    if grouped:
        conn.execute(
            sa.text("insert into conversations (conversation_id) values (:c)"),
            [{"c": c} for c in sorted(set(grouped.values()))],
        )
        conn.execute(
            sa.text("insert into conversation_sessions values (:s, :c)"), [{"s": s, "c": c} for s, c in grouped.items()]
        )


def downgrade() -> None:
    op.drop_index("ix_conversation_sessions_conversation", "conversation_sessions")
    op.drop_table("conversation_sessions")
    op.drop_table("conversations")
