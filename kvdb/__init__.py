"""kvdb: a persistent archive for the KV caches of transformer language models.

import kvdb
with kvdb.open("my.duckdb") as db:
    db.ingest("examples/transcripts")
    session = db.sessions()[0]
    print(db.text(session.session_id))
    print(db.continue_session(session.session_id, prompt="And then?"))
"""

from kvdb.archive import Archive, SessionHandle, default_path, open
from kvdb.errors import KvdbError
from kvdb.records import IngestResult, Prefix, RestoredSession, Session, Stats
from kvdb.transcripts.formats import registered as formats

__all__ = [
    "Archive",
    "IngestResult",
    "KvdbError",
    "Prefix",
    "RestoredSession",
    "Session",
    "SessionHandle",
    "Stats",
    "default_path",
    "formats",
    "open",
]
__version__ = "0.1.0"
