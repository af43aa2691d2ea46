"""The token tier becomes one a node may drop: `keep` names it explicitly.

A node whose tokens live only in tier L (`kvdb compact --keep lm`) keeps its `token_streams`
row (alphabet, block size, length) and loses its `token_blocks`; every node written before this
revision holds its token blocks, so "tokens" is added to its `keep`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "UPDATE nodes SET keep = CASE WHEN keep IS NULL THEN 'search,tokens' WHEN keep = '' THEN 'tokens' ELSE keep || ',tokens' END"
    )


def downgrade() -> None:
    op.execute("UPDATE nodes SET keep = regexp_replace(regexp_replace(keep, ',?tokens', ''), '^,', '')")
