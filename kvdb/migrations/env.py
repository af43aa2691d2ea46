"""Alembic environment: kvdb runs migrations itself, on the connection it opened.

Importing kvdb.storage.migrate registers alembic's DuckDB implementation.
"""

from alembic import context

import kvdb.storage.migrate  # noqa: F401  (registers the duckdb dialect with alembic)

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("kvdb migrations run through kvdb.storage.migrate.upgrade, which passes its connection")

context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
