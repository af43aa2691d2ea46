"""kvdb's Python API in one page: ingest transcripts, read one back, restore one and continue it.

Run with `make demo` (which installs everything first) or `.venv/bin/python examples/quickstart.py`.
The archive goes to $KVDB_DB, else examples/demo.duckdb.
"""

import os
import time
from pathlib import Path

import kvdb

HERE = Path(__file__).parent
ARCHIVE = os.environ.get("KVDB_DB") or HERE / "demo.duckdb"

with kvdb.open(ARCHIVE) as db:
    start = time.perf_counter()
    db.loaded_model  # load the embedded model (the first run converts its GGUF once, ~20 s)
    print(f"model {db.loaded_model.identity.name} loaded in {time.perf_counter() - start:.1f}s")

    start = time.perf_counter()
    results = db.ingest(HERE / "transcripts")
    seconds = time.perf_counter() - start
    for r in results:
        print(f"{r.status:<10} {r.session_id[:12] if r.session_id else '-':<12} {r.n_tokens:>5} tok  {r.name}")
    new_tokens = sum(r.n_tokens for r in results if r.status == "ingested")
    if new_tokens:
        print(f"ingested {new_tokens} tokens in {seconds:.1f}s ({new_tokens / seconds:.0f} tokens/s): the tokenizer alone")
    report = db.upkeep()  # the models' work ingest queued: the semantic tier, then log-probabilities and exact caches
    print(f"upkeep: embedded {report.embedded.sessions} sessions and scored {report.scored.sessions} in {report.seconds:.1f}s")

    print("\n--- show: the story, exactly as written ---")
    print(db.text("story"))

    chat = db.session("chat")
    print(f"--- restore {chat.name} ({chat.n_tokens} tokens) and continue ---")
    restored = db.restore(chat.session_id)
    print(f"restored {restored.position} tokens in {restored.seconds:.2f}s (mode {restored.mode})")
    print(db.generate(restored, prompt="Thanks! Can you show the fixed line of code?", max_new_tokens=60))

    print("\n--- continue the story from its 40th token ---")
    print(db.continue_session("story", at=40, max_new_tokens=30))

    print("\n--- search: where does 'the sea' occur? ---")
    for hit in db.search("the sea", k=3, context=12):
        grade = "exact" if hit.exact else f"{hit.match_tokens}/{hit.query_tokens} tokens"
        print(f"{hit.name} @{hit.position} [{grade}]: ...{hit.before}[{hit.match}]{hit.after}...".replace("\n", " "))

    print("\n--- prefixes several sessions share (stored once) ---")
    for prefix in db.prefixes():
        print(f"{prefix.tokens:>4} tokens, {prefix.bits:7.1f} bits, {prefix.sessions} sessions: {prefix.text}")

    stats = db.stats()
    print("\n--- stats ---")
    print(f"{stats.sessions} sessions, {stats.tokens} tokens, {stats.stored_tokens} stored once in {stats.nodes} trie nodes")
    for tier, per_token in stats.bytes_per_token.items():
        print(f"  {tier:<9} {stats.bytes[tier]:>8} B  {per_token:.2f} B/token")
