"""The services behind the :class:`kvdb.Archive` facade, one concern each."""
