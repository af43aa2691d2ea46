"""Phrase search on a tiny byte-level model: every occurrence found, ranking, deletes, rebuilds."""

from pathlib import Path

import numpy as np
import pytest
from support import write

import kvdb
from kvdb.errors import InvalidArgument
from kvdb.index import phrase as search_ops
from kvdb.index import trie
from kvdb.index.walk import WalkIndex
from kvdb.model import tokenizer as tok
from kvdb.services.searching import casings as search_ops_casings

TEXTS = {
    "harbour": (
        "The keeper watched the harbour lights. Ships passed the harbour lights at dusk, "
        "and the harbour lights answered."
    ),
    "garden": "In the garden the basil grew tall. The harbour lights were far away from the garden.",
    "kitchen": "Lentils, onions and cumin simmer slowly. Nothing about lights here, only soup and bread.",
    "log": "harbour lights harbour lights harbour lights",
}


@pytest.fixture
def db(archive):
    for name, text in TEXTS.items():
        archive.ingest(text=text, name=name)
    return archive


def occurrences(db, phrase):
    """Ground truth: (session_id, first position) of every token-level occurrence of the phrase."""
    want = np.asarray(tok.encode(db.loaded_model.tokenizer, phrase))
    found = set()
    for s in db.sessions():
        ids = db.tokens(s.session_id)
        for i in range(len(ids) - len(want) + 1):
            if np.array_equal(ids[i : i + len(want)], want):
                found.add((s.session_id, i))
    return found


@pytest.mark.parametrize(
    "phrase", ["harbour lights", "lights", "the garden", "ouo", "Ships passed the harbour lights at dusk"]
)
def test_every_occurrence_is_found(db, phrase):
    truth = occurrences(db, phrase)
    hits = db.search(phrase, k=len(truth) + 20, context=4, each_occurrence=True)
    exact = {(h.session_id, h.position) for h in hits if h.exact and h.query_tokens == len(phrase.encode())}
    assert exact == truth
    for h in hits:
        assert phrase.endswith(h.match) or (" " + phrase).endswith(h.match)
        assert db.text(h.session_id, h.position, h.position + h.match_tokens) == h.match
        assert h.match in h.context


def test_partial_matches_rank_below_full_ones(db):
    hits = db.search("blue harbour lights", k=30, context=2)  # "blue " occurs nowhere before it
    assert hits and not any(h.exact for h in hits)
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    assert hits[0].match.endswith("harbour lights") and hits[0].match_tokens >= len(" harbour lights")
    mixed = db.search("lights", k=100)
    grades = [h.exact for h in mixed]
    assert grades == sorted(grades, reverse=True)  # every exact hit before every partial one


def test_phrase_that_occurs_nowhere_has_no_exact_hit(db):
    assert not any(h.exact for h in db.search("zebra quartz", k=10))


def test_long_phrase_is_one_range(db):
    phrase = "Lentils, onions and cumin simmer slowly."  # ~40 tokens: ten keys
    [hit] = [h for h in db.search(phrase, k=5) if h.exact]
    assert hit.name == "kitchen" and hit.position == 0 and hit.match == phrase
    near = db.search("Lentils, onions and cumin simmer quickly.", k=3)
    assert not any(h.exact for h in near)


def test_deleted_sessions_are_never_returned(db):
    gone = db.session("log").session_id
    db.delete(gone)
    assert all(h.session_id != gone for h in db.search("harbour lights", k=50))


def test_rebuilt_index_answers_as_the_incremental_one(db):
    before = [h.to_dict() for h in db.search("harbour lights", k=50)]
    db.delete("garden")
    after_delete = [h.to_dict() for h in db.search("harbour lights", k=50)]
    report = db.rebuild_index()
    assert report.sessions == len(TEXTS) - 1
    assert [h.to_dict() for h in db.search("harbour lights", k=50)] == after_delete
    assert len(before) > len(after_delete)


def test_missing_or_damaged_sidecar_is_rebuilt(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text=TEXTS["harbour"], name="harbour")
        expected = [h.to_dict() for h in db.search("harbour lights", k=10)]
    files = sorted((tmp_path / "a.duckdb.index").glob("*.*"))
    assert [f.suffix for f in files] == [".keys", ".tail"]  # the base and the tail that follows it
    for sidecar in files:
        sidecar.write_bytes(sidecar.read_bytes()[:-7] + b"garbage")
        with kvdb.open(path, model=tiny_model) as db:
            assert [h.to_dict() for h in db.search("harbour lights", k=10)] == expected
    for sidecar in files:
        sidecar.unlink()
        with kvdb.open(path, model=tiny_model) as db:
            assert [h.to_dict() for h in db.search("harbour lights", k=10)] == expected


@pytest.mark.parametrize("old", ["index/a259.keys", "index/v4/a259.keys", "index/v5/a259.keys"])
def test_a_sidecar_of_an_old_format_is_rebuilt(tmp_path, tiny_model, old):
    """Index files earlier versions wrote (kvdb 0.1.0's KVDBIDX3, every key stored; KVDBIDX4,
    ordered by one key; KVDBIDX5, by 32 tokens) are rebuilt in today's format."""
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text=TEXTS["harbour"], name="harbour")
        expected = [h.to_dict() for h in db.search("harbour lights", k=10)]
    [base] = (tmp_path / "a.duckdb.index").glob("*.keys")
    golden = Path(__file__).parents[1] / "fixtures/golden" / old
    base.write_bytes(golden.read_bytes())
    tail = golden.with_suffix(".tail")
    base.with_suffix(".tail").write_bytes(tail.read_bytes()) if tail.is_file() else base.with_suffix(".tail").unlink()
    with kvdb.open(path, model=tiny_model) as db:
        assert [h.to_dict() for h in db.search("harbour lights", k=10)] == expected
    assert base.read_bytes().startswith(b"KVDBIDX7")


def test_index_behind_the_database_is_detected(tmp_path, tiny_model):
    """A crash after the sidecar was written but before the commit leaves them disagreeing."""
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text=TEXTS["harbour"], name="harbour")
    old = {sidecar: sidecar.read_bytes() for sidecar in (tmp_path / "a.duckdb.index").glob("*.*")}
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text=TEXTS["garden"], name="garden")
    for sidecar, data in old.items():
        sidecar.write_bytes(data)  # the index now misses the garden session
    with kvdb.open(path, model=tiny_model) as db:
        assert {h.name for h in db.search("the garden", k=10) if h.exact} == {"garden"}


def test_hit_position_restores(db):
    hit = next(h for h in db.search("harbour lights", k=5) if h.exact)
    restored = db.restore(hit.session_id, at=hit.position)
    assert restored.position == hit.position
    assert db.text(hit.session_id, hit.position, hit.position + hit.match_tokens) == "harbour lights"


def test_session_filter(db):
    only = db.search("harbour lights", k=50, session="garden")
    assert only and {h.name for h in only} == {"garden"}


def test_clear_errors_and_empty_archive(archive, db):
    with pytest.raises(InvalidArgument, match="empty search phrase"):
        db.search("   ")
    with pytest.raises(InvalidArgument, match="at most"):
        db.search("x" * (search_ops.MAX_PHRASE_TOKENS + 1))


def test_empty_archive_returns_nothing(tmp_path, tiny_model):
    with kvdb.open(tmp_path / "empty.duckdb", model=tiny_model) as db:
        assert db.search("anything") == []


def test_cli_search(tmp_path, tiny_model):
    import json

    from click.testing import CliRunner

    from kvdb.cli.main import main

    write(tmp_path / "t" / "harbour.txt", TEXTS["harbour"])
    runner = CliRunner()
    args = ["--db", str(tmp_path / "c.duckdb")]
    env = {"KVDB_MODEL": tiny_model}
    missing = runner.invoke(main, [*args, "search", "lights"], env=env)
    assert missing.exit_code == 5 and "no archive at" in missing.stderr  # reading creates no archive
    assert runner.invoke(main, [*args, "gc"], env=env).exit_code == 0  # a write creates an empty one
    empty = runner.invoke(main, [*args, "search", "lights"], env=env)
    assert empty.exit_code == 1 and "archive is empty" in empty.stderr
    assert runner.invoke(main, [*args, "ingest", str(tmp_path / "t")], env=env).exit_code == 0
    out = runner.invoke(
        main, [*args, "search", "harbour lights", "-k", "3", "--context", "5", "--each-occurrence", "--json"], env=env
    )
    assert out.exit_code == 0
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 3 and all(
        set(r)
        == {
            "session_id",
            "conversation_id",
            "title",
            "name",
            "position",
            "match_tokens",
            "query_tokens",
            "score",
            "exact",
            "partial",
            "context",
            "before",
            "match",
            "after",
        }
        for r in rows
    )
    assert all(
        r["exact"] and not r["partial"] and r["name"] == "harbour" and "harbour lights" in r["context"] for r in rows
    )
    once = [
        json.loads(line)
        for line in runner.invoke(
            main, [*args, "search", "harbour lights", "-k", "3", "--json"], env=env
        ).stdout.splitlines()
    ]
    assert [r["session_id"] for r in once] == [rows[0]["session_id"]] and once[0][
        "title"
    ] == "harbour"  # one conversation, one hit: its best
    human = runner.invoke(main, [*args, "search", "harbour lights", "-k", "1"], env=env)
    assert human.stdout.startswith("harbour ") and " @" in human.stdout and "[exact]" in human.stdout
    none = runner.invoke(main, [*args, "search", "qqqzzz", "--json"], env=env)
    # the noqa: `l` is a line of the output (E741: ambiguous name), the name kept as written
    assert none.exit_code == 1 and not any(json.loads(l)["exact"] for l in none.stdout.splitlines())  # noqa: E741
    rebuilt = runner.invoke(main, [*args, "index", "rebuild", "--json"], env=env)
    assert rebuilt.exit_code == 0 and json.loads(rebuilt.stdout)["sessions"] == 1


def test_casings_are_the_phrase_as_typed_then_lower_sentence_title_and_upper_case():
    assert search_ops_casings("infrastructure deficit") == [
        "infrastructure deficit",
        "Infrastructure deficit",
        "Infrastructure Deficit",
        "INFRASTRUCTURE DEFICIT",
    ]
    assert search_ops_casings("Leggy")[:2] == ["Leggy", "leggy"] and search_ops_casings("42 ships")[1:3] == [
        "42 Ships",
        "42 SHIPS",
    ]


def test_search_finds_other_casings_unless_told_to_match_case(archive):
    archive.ingest(
        text="The council heard of an Infrastructure Deficit, and of LEGGY birds by the Harbour.", name="minutes"
    )
    for phrase, found in (
        ("infrastructure deficit", "Infrastructure Deficit"),
        ("leggy", "LEGGY"),
        ("HARBOUR", "Harbour"),
    ):
        [hit] = [h for h in archive.search(phrase, k=5) if h.exact]
        assert hit.match.strip() == found
        assert not [h for h in archive.search(phrase, k=5, case_sensitive=True) if h.exact]


def test_partial_hits_match_at_least_the_share_asked_for(db):
    everything = db.search("blue harbour lights", k=200, min_share=0)
    assert min(h.match_tokens / h.query_tokens for h in everything) < 0.5  # "s" alone, and the like
    default = db.search("blue harbour lights", k=200)
    assert default and all(h.match_tokens / h.query_tokens >= search_ops.MIN_SHARE for h in default)
    assert {(h.session_id, h.position) for h in default} == {
        (h.session_id, h.position) for h in everything if h.match_tokens / h.query_tokens >= 0.5
    }
    assert db.search("blue harbour lights", k=200, min_share=1) == []
    with pytest.raises(InvalidArgument, match="min_share"):
        db.search("harbour", min_share=1.5)


@pytest.mark.parametrize(
    "phrase", ["harbour lights", "lights", "the garden", "ouo", "Ships passed the harbour lights at dusk", "zebra"]
)
def test_count_is_the_number_of_places_that_hold_the_phrase(db, phrase):
    assert db.count(phrase, case_sensitive=True).count == len(occurrences(db, phrase))
    exact = [h for h in db.search(phrase, k=1000, each_occurrence=True) if h.exact]  # every casing, each position once
    assert db.count(phrase).count == len(exact)
    assert db.count(phrase, session="harbour").count == len(
        {h.position for h in db.search(phrase, k=1000, session="harbour") if h.exact}
    )


def test_count_crosses_nodes_and_counts_a_shared_position_once(archive):
    first = "The keeper watched the harbour lights."
    archive.ingest(text=first, name="a")
    archive.ingest(text=first + " Ships passed at dusk.", name="b")  # the first session's node, and a child
    assert archive.count("keeper watched").count == 1  # in the node both sessions share
    across = "harbour lights. Ships passed"  # from the shared node into the child
    assert archive.count(across).count == 1 == len([h for h in archive.search(across) if h.exact])
    assert archive.count("lights. Ships passed at dusk.").count == 1


def test_a_phrase_of_any_length_is_counted_as_one_range(archive, monkeypatch):
    """Every phrase a search takes (up to 256 tokens) is one range of the index's order, across
    node boundaries and however deep into the path before a node: its count reads no session."""
    first = "The keeper watched the harbour lights from the old stone tower, night after night, for forty years. "
    later = "Ships passed at dusk, and the lights answered them one by one, as they had always done. " * 3
    archive.ingest(text=first, name="a")
    archive.ingest(text=first + later, name="b")  # a's node, and a child of it
    archive.ingest(text="Far inland, " + first, name="c")  # the same words after another start: a node of its own
    monkeypatch.setattr(trie.TrieView, "windows", lambda *_: pytest.fail("a count read the archive"))
    tokens = len(tok.encode(archive.loaded_model.tokenizer, first + later))
    assert 256 < tokens
    assert archive.count(first[4:]).count == 2  # the node a and b share, once, and c's
    across = (first + later)[40:290]  # from deep in a's node to deep in b's: up to 256 tokens
    assert 200 < len(tok.encode(archive.loaded_model.tokenizer, across)) <= 256
    assert archive.count(across, case_sensitive=True).count == 1
    assert archive.count(across.replace("Ships", "Boats"), case_sensitive=True).count == 0
    assert archive.count(first[4:] + "Boats", case_sensitive=True).count == 0


def test_a_node_is_searched_across_its_link_to_the_path_before_it(tmp_path, tiny_loaded):
    """A node whose path before it holds 255 tokens or more keeps a link to a slot that holds
    them (found by a lookup when it is committed), not the tokens: a phrase across the node's
    start is found through the link, in this process and once the sidecar is mapped again."""
    path = tmp_path / "a.duckdb"
    first = "The keeper watched the harbour lights from the old stone tower, night after night. " * 4
    later = "Ships passed at dusk, and the lights answered them one by one."
    across = (first + later)[len(first) - 120 : len(first) + 40]
    with kvdb.open(path, model=tiny_loaded) as db:
        db.ingest(text=first, name="a")
        db.ingest(text=first + later, name="b")  # a's node, and a child whose path before it is ~330 tokens
        assert db.count(across, case_sensitive=True).count == 1
    [base] = (tmp_path / "a.duckdb.index").glob("*.keys")
    index = WalkIndex.load(base)
    assert (np.concatenate([index.base.runs.link, index.tail.runs.link]) >= 0).any()
    with kvdb.open(path, model=tiny_loaded) as db:
        assert db.count(across, case_sensitive=True).count == 1
        [hit] = [h for h in db.search(across, k=3, case_sensitive=True) if h.exact]
        assert hit.name == "b" and hit.match == across


def test_count_leaves_out_deleted_sessions(db):
    before = db.count("harbour lights").count
    db.delete("log")  # its positions stay in the index until gc: counted by locating them
    assert db.count("harbour lights").count == before - 3
    assert db.count("Ships passed the harbour lights at dusk").count == 1
