"""Alembic environment and versions of the kvdb archive schema (installed as ``kvdb.migrations``)."""
