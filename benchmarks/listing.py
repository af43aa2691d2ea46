"""Listing and filtering conversations at a history's scale (issue 53: `sessions --project X`,
MCP `sessions` and a filtered search's scope within 50 ms at 50k conversations).

A synthetic archive is written straight into the tables, without the model or the tokenizer:
``--conversations`` conversations of one to three versions (a log ingested as it grew), over
``--projects`` project folders and three agents, each session with metadata of the size real
agent logs give (a few hundred bytes; tests/fixtures/exports: median 259, p90 1.7k), its trie
leaf and token stream row (what the trie view and the ``branches`` of a listed conversation
read). The conversations table's listing columns are filled as migration 0012 fills them.
Then, each the best of ``--repeats`` after a warm-up, on a file and (``--lake``) on a DuckLake
copy of it on PostgreSQL:

- ``conversations(project=X)``: all of one project's conversations, as `kvdb sessions --project X`;
- ``conversation_page(limit=20)``: MCP `sessions`' first page, and one filtered by project;
- a filtered search's scope: the admitted conversations (one query), then the trie paths a search
  keeps to (``owners_within`` on a trie view already loaded, as a search holds it);
- `kvdb sessions --project X` as a command, start to end (a new interpreter each time);
- ``conversations()`` unfiltered (`kvdb sessions`), and the listing as it ran before migration 0012:
  every session read and every conversation built in Python, then filtered.

    .venv/bin/python benchmarks/listing.py [--conversations 50000] [--projects 50] [--repeats 5] [--lake]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests")]

import kvdb  # noqa: E402
from kvdb.index.trie import TrieView  # noqa: E402
from kvdb.storage import open_storage  # noqa: E402

AGENTS = ("claude-code", "codex-cli", "gemini-cli")


def build(path: Path, conversations: int, projects: int) -> None:
    """The tables of an archive of ``conversations`` conversations, written in a few statements."""
    open_storage(path).close()  # the schema at head
    con = duckdb.connect(str(path))
    con.execute("insert into models values ('m', 'bench', 'w', 't', '{}', now())")
    # conversation i has 1 + (i % 3 == 0) + (i % 7 == 0) versions; version v of it is archived v hours after its first
    con.execute(
        """
        create temp table v as
        select i, v, md5('s' || i || '-' || v) as session_id, md5('s' || i || '-1') as conversation_id,
               '/home/user/projects/p' || (i % ?) as project, ? [1 + i % 3] as agent,
               timestamp '2024-01-01' + to_minutes(i * 10) + to_hours(v - 1) as created_at,
               1 + (i % 3 = 0)::int + (i % 7 = 0)::int as versions
        from range(?) r(i), range(1, 4) w(v)
        where v <= 1 + (i % 3 = 0)::int + (i % 7 = 0)::int
        """,
        [projects, list(AGENTS), conversations],
    )
    con.execute(
        """
        insert into sessions
        select session_id, 'session-' || i, project || '/session-' || i || '.jsonl', 'm', created_at, 400 * v,
               json_object('format', agent, 'cwd', project, 'id', md5('id' || i), 'line', 1,
                           'started', strftime(created_at - to_minutes(30), '%Y-%m-%dT%H:%M:%S'),
                           'ended', strftime(created_at - to_minutes(1), '%Y-%m-%dT%H:%M:%S'),
                           'side', json_object('summaries', [md5('a' || i) || ' ' || md5('b' || i) || ' ' || \
md5('c' || i) || ' ' || md5('d' || i)]))::varchar
        from v
        """
    )
    con.execute("insert into conversation_sessions select session_id, conversation_id from v")
    con.execute(
        """
        insert into conversations
        select conversation_id, null, max(versions), max(created_at), arg_max(session_id, v), \
max(created_at) - to_minutes(1),
               any_value(agent), any_value(project), any_value(project)
        from v group by conversation_id
        """
    )
    # each version a node under the version before it (a log that grew): the first versions of grown ones are extended
    con.execute(
        """
        insert into nodes
        select session_id, case when v > 1 then md5('s' || i || '-' || (v - 1)) end, 'm', 400 * (v - 1), 400, 0,
               versions - v + 1, 'tokens,search' from v
        """
    )
    con.execute("insert into token_streams select session_id, 65536, 4096, 400 from v")
    con.execute("checkpoint")
    con.close()


def best(repeats: int, call) -> float:
    call()  # warm: the connection, the caches of the first query
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def measure(location: str, repeats: int, label: str) -> None:
    project = "/home/user/projects/p7"
    with kvdb.open(location, read_only=True) as archive:
        mine = archive.conversations(project=project)
        print(f"{label}: {archive.conversation_page(limit=1).total} conversations, {len(mine)} of them in {project}")
        listed = best(repeats, lambda: archive.conversations(project=project))
        print(f"  conversations(project=X)           {listed:8.1f} ms  ({len(mine)} conversations built)")
        print(
            "  conversation_page(limit=20)        "
            f"{best(repeats, lambda: archive.conversation_page(limit=20)):8.1f} ms  (MCP sessions)"
        )
        print(
            "  conversation_page(project, 20)     "
            f"{best(repeats, lambda: archive.conversation_page(project=project, limit=20)):8.1f} ms"
        )
        conversations = archive._conversations
        print(
            "  scope(project=X): the query        "
            f"{best(repeats, lambda: conversations.scope(None, project, None, None)):8.1f} ms"
        )
        view = TrieView.load(archive._storage)
        within = conversations.scope(None, project, None, None) or set()
        fresh = lambda: dataclasses.replace(view)  # noqa: E731
        owners = best(repeats, lambda: view.owners_within(within))
        print(
            f"  owners_within(X), view loaded      {owners:8.1f} ms  (first on a new view: {first_call(fresh):.1f} ms)"
        )
        print(
            "  conversations(): every one         "
            f"{best(min(repeats, 2), archive.conversations):8.1f} ms  (`kvdb sessions`, no filter)"
        )
        print(
            "  before: every session read, then X "
            f"{best(min(repeats, 2), lambda: listed_before(archive, project)):8.1f} ms  (the listing before 0012)"
        )


def listed_before(archive, project: str) -> list:
    """What the listing did before it ran in SQL: every session read and every conversation built,
    then filtered in Python (``Conversations.listed`` at 0011, its records built as they were then)."""
    from kvdb.records import Conversation, Session

    storage = archive._storage
    grouped: dict[str, list] = {}
    for row in storage.list_sessions():
        grouped.setdefault(row.conversation_id, []).append(row)
    titles, extended = storage.conversation_titles(), storage.extended_sessions()
    out = []
    for conversation_id, rows in grouped.items():
        first, latest = Session.from_row(rows[0]), Session.from_row(rows[-1])
        followed = {r.metadata["part"]["follows"] for r in rows if (r.metadata.get("part") or {}).get("follows")}
        ends = sum(r.session_id not in extended and r.session_id not in followed for r in rows)
        folder = next((str(r.metadata["cwd"]) for r in rows if r.metadata.get("cwd")), first.project)
        title = titles.get(conversation_id) or next(
            (
                r.metadata["title"]
                for r in reversed(rows)
                if isinstance(r.metadata.get("title"), str) and r.metadata["title"]
            ),
            first.name,
        )
        if folder is not None and (folder + "/").startswith(project + "/"):
            out.append(
                Conversation(conversation_id, title, latest, first.started_at, len(rows), ends, first.agent, folder)
            )
    return sorted(out, key=lambda x: (x.latest.created_at, x.conversation_id), reverse=True)


def first_call(fresh) -> float:
    """``owners_within`` on a view whose per-snapshot maps are not derived yet (once per version)."""
    view = fresh()
    start = time.perf_counter()
    view.owners_within(set())
    return 1e3 * (time.perf_counter() - start)


def command(location: str, repeats: int, *args: str) -> float:
    argv = [str(Path(sys.executable).with_name("kvdb")), "--db", location, "sessions", *args]
    return best(repeats, lambda: subprocess.run(argv, check=True, capture_output=True, env=dict(os.environ)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=50_000)
    parser.add_argument("--projects", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--lake", action="store_true", help="also on a DuckLake copy (PostgreSQL from tests/postgres.py)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "listing.duckdb"
        start = time.perf_counter()
        build(path, args.conversations, args.projects)
        print(
            f"built {args.conversations} conversations in "
            f"{time.perf_counter() - start:.1f} s ({path.stat().st_size / 1e6:.0f} MB)"
        )
        measure(str(path), args.repeats, "file")
        runs = min(args.repeats, 3)
        cli = command(str(path), runs, "--project", "/home/user/projects/p7")
        print(f"  kvdb sessions --project X          {cli:8.1f} ms  (a new interpreter, start to end)")
        print(
            "  kvdb sessions --agent nobody       "
            f"{command(str(path), runs, '--agent', 'nobody'):8.1f} ms  (the same, listing nothing)"
        )
        if args.lake:
            from postgres import Cluster

            cluster = Cluster().start()
            try:
                where = f"ducklake:postgres:{cluster.new_database()}"
                start = time.perf_counter()
                with kvdb.open(path, read_only=True) as archive:
                    archive.copy_to(where, data_path=Path(folder) / "lake-data")
                with kvdb.open(where) as lake:
                    lake.gc()  # the copy's many small Parquet files merged, as upkeep leaves a lake
                print(f"copied to a lake in {time.perf_counter() - start:.1f} s")
                measure(where, args.repeats, "lake")
            finally:
                cluster.stop()


if __name__ == "__main__":
    main()
