"""The semantic tier's mechanics on the tiny model, which also serves as its embedder (mean
pooling over its last hidden states): chunking, the tier's round trip, adding it later, a
split, and the search's hits. Quality is measured by benchmarks/retrieval.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import kvdb
from kvdb.cli.main import main
from kvdb.errors import InvalidArgument, TierMissing
from kvdb.index import chunks as chunk_ops
from kvdb.model.embedder import Embedder

SEMANTIC = "tokens,search,semantic"
PHRASES = "tokens,search"
TRIP = [
    {"role": "user", "content": "Plan a three day walking trip through the Lake District."},
    {
        "role": "assistant",
        "content": "Day one: Keswick to Buttermere over Cat Bells. Day two: Honister. Day three: back by the lake.",
    },
]
BREAD = [
    {"role": "user", "content": "Why did my sourdough come out flat?"},
    {"role": "assistant", "content": "The starter was weak or the dough over-proofed; try a shorter rise."},
]


@pytest.fixture(scope="module")
def embedder(tiny_model):
    return Embedder(tiny_model)


@pytest.fixture
def db(tmp_path, tiny_loaded, embedder):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded, embedder=embedder) as archive:
        yield archive


def chunk_rows(archive) -> list[tuple]:
    from kvdb.storage.sql_rows import CHUNK

    with archive._storage._read() as conn:
        return conn.execute(f"select {CHUNK} from node_chunks order by start, stop").fetchall()


def _embedded(archive, **ingest):
    """Ingest, then embed what it queued (ingest runs no model: ``kvdb upkeep`` embeds)."""
    results = archive.ingest(**ingest)
    archive.upkeep(only="semantic")
    return results


def test_turns_are_cut_into_overlapping_windows_that_depend_only_on_the_prefix():
    spans = chunk_ops.spans([(0, 10), (10, 300)], window=128, overlap=32)
    assert spans.tolist() == [[0, 10], [10, 138], [106, 234], [202, 300]]
    assert all(b - a <= 128 for a, b in spans) and np.all(np.diff(spans[:, 0]) > 0)
    longer = chunk_ops.spans([(0, 10), (10, 500)], window=128, overlap=32)
    assert (
        longer[:3].tolist() == spans[:3].tolist()
    )  # a longer session keeps the chunks that end where the shorter one's do
    assert spans[chunk_ops.ending_in(spans, 100, 234)].tolist() == [[10, 138], [106, 234]]
    with pytest.raises(ValueError):
        chunk_ops.spans([(0, 10)], window=8, overlap=8)


def test_a_chunks_own_words_find_it_and_its_position_restores(db):
    _embedded(db, messages=TRIP, name="trip", keep=SEMANTIC)
    _embedded(db, messages=BREAD, name="bread", keep=SEMANTIC)
    [hit, *rest] = db.search_meaning(BREAD[1]["content"], k=2)
    assert (hit.name, [h.name for h in rest]) == ("bread", ["trip"])
    assert (
        hit.score > rest[0].score and BREAD[1]["content"] in hit.context and "<|im_start|>" not in hit.context
    )  # the text, no template tokens
    assert BREAD[1]["content"] in db.text("bread", hit.position, hit.position + hit.match_tokens)  # a chunk is its turn
    assert db.restore("bread", at=hit.position, mode="exact").position == hit.position
    assert [h.name for h in db.search_meaning(TRIP[0]["content"], k=5, session="bread")] == ["bread"]
    assert json.loads(json.dumps(hit.to_dict()))["position"] == hit.position
    with pytest.raises(InvalidArgument):
        db.search_meaning("  ")


def test_the_tier_is_added_later_like_any_other(db):
    db.ingest(messages=TRIP, name="trip", keep=PHRASES)
    with pytest.raises(TierMissing, match="--keep tokens,search,semantic"):
        db.search_meaning("walking")
    [result] = db.ingest(messages=TRIP, name="trip", keep=SEMANTIC)
    assert (result.status, result.added) == (
        "unchanged",
        (),
    ) and db.pending().semantic.sessions == 1  # queued, not embedded by the ingest
    assert db.upkeep(only="semantic").embedded.sessions == 1
    assert db.search_meaning(TRIP[1]["content"], k=1)[0].name == "trip"
    db.ingest(messages=[*BREAD, {"role": "user", "content": "And rye?"}], name="rye", keep=PHRASES)
    db.ingest(
        messages=[*BREAD, {"role": "user", "content": "And spelt?"}], name="spelt", keep=PHRASES
    )  # a path of two nodes, both without the tier
    [result] = db.ingest(messages=[*BREAD, {"role": "user", "content": "And spelt?"}], name="spelt", keep=SEMANTIC)
    assert result.status == "unchanged" and db.upkeep(only="semantic").embedded.sessions == 1
    nodes = {n.node_id: n for n in db._storage.nodes_of([db.sessions()[0].model_id])}
    spans = [(row[2], row[3]) for row in chunk_rows(db)]
    assert len(spans) == len(set(spans)) and all(
        nodes[row[0]].start < row[3] <= nodes[row[0]].end for row in chunk_rows(db)
    )
    assert len({row[0] for row in chunk_rows(db)}) == 3  # trip's node, and both nodes of spelt's path, in one pass
    # rye's own turn has no chunk, but the shared turns, which rye (the older) owns, do
    assert {h.name for h in db.search_meaning("And spelt?", k=3)} == {"trip", "rye", "spelt"}


def test_a_shared_prefix_is_embedded_once_and_a_split_keeps_each_chunk_whole(db):
    _embedded(db, messages=[*TRIP, {"role": "user", "content": "And in winter?"}], name="winter", keep=SEMANTIC)
    before = chunk_rows(db)
    _embedded(
        db, messages=[*TRIP, {"role": "user", "content": "What should I pack?"}], name="pack", keep=SEMANTIC
    )  # splits the first node
    after = chunk_rows(db)
    spans = [(row[2], row[3]) for row in after]
    assert len(spans) == len(set(spans)) == len(before) + 1  # the shared turns once, the new turn added
    nodes = {n.node_id: n for n in db._storage.nodes_of([db.sessions()[0].model_id])}
    assert all(
        nodes[row[0]].start < row[3] <= nodes[row[0]].start + nodes[row[0]].n_tokens for row in after
    )  # each with the node of its last token
    assert db.stats().bytes["semantic"] == len(after) * (
        2 * 64 + 56
    )  # float16 vectors of the tiny model's 64 dimensions, and each row's keys
    assert db.search_meaning("What should I pack?", k=1)[0].name == "pack"
    assert db.search_meaning("And in winter?", k=1)[0].name == "winter"


def test_search_by_meaning_on_the_command_line(tmp_path, tiny_model):
    env = {"KVDB_MODEL": tiny_model, "KVDB_EMBEDDER": tiny_model}
    chat = tmp_path / "bread.json"
    chat.write_text(json.dumps({"messages": BREAD}))
    runner = CliRunner()
    args = ["--db", str(tmp_path / "c.duckdb")]
    assert runner.invoke(main, [*args, "ingest", str(chat), "--keep", SEMANTIC], env=env).exit_code == 0
    waiting = runner.invoke(main, [*args, "search", "--semantic", BREAD[0]["content"]], env=env)
    assert waiting.exit_code == 2 and "run `kvdb upkeep`" in waiting.stderr  # ingest embeds nothing: upkeep does
    assert runner.invoke(main, [*args, "upkeep", "--only", "semantic"], env=env).exit_code == 0
    found = runner.invoke(main, [*args, "search", "--semantic", BREAD[0]["content"], "--json"], env=env)
    [line] = [json.loads(x) for x in found.stdout.splitlines()]
    assert found.exit_code == 0 and line["name"] == "bread" and BREAD[0]["content"] in line["context"]
    shown = runner.invoke(main, [*args, "search", "--semantic", BREAD[0]["content"]], env=env)
    assert shown.exit_code == 0 and shown.stdout.startswith("bread ") and "[score " in shown.stdout  # the fused score


# the index kept between processes (kvdb.index.chunk_index, ChunkIndexes) ------------------------


def _indexes(archive):
    return archive._semantic.indexes


def _chunk_nodes(archive) -> set[str]:
    return {row[0] for row in chunk_rows(archive)}


@pytest.mark.parametrize("backend", ["file", pytest.param("lake", marks=pytest.mark.slow)])
def test_another_writers_sessions_are_read_alone_and_the_sidecar_serves_the_next_process(
    request, tmp_path, tiny_loaded, embedder, backend
):
    where, data_path = (tmp_path / "a.duckdb", None) if backend == "file" else request.getfixturevalue("lake")

    def opened():
        return kvdb.open(where, model=tiny_loaded, embedder=embedder, data_path=data_path)

    with opened() as first:
        _embedded(first, messages=TRIP, name="trip", keep=SEMANTIC)
        assert first.search_meaning(TRIP[1]["content"], k=1)[0].name == "trip"
        indexes, had = _indexes(first), _chunk_nodes(first)
        assert indexes.rebuilt == [embedder.embedder_id] and indexes.path(embedder.embedder_id).exists()
        first._storage.release()  # as another process would find it: not held
        with opened() as second:
            _embedded(second, messages=BREAD, name="bread", keep=SEMANTIC)
        new = _chunk_nodes(first) - had
        assert new and first.search_meaning(BREAD[1]["content"], k=1)[0].name == "bread"
        assert (
            indexes.rebuilt == [embedder.embedder_id] and set(indexes.read) == new
        )  # caught up: only the new session's nodes read
    with opened() as later:  # a new process: the sidecar, saved after catching up, is current
        assert [h.name for h in later.search_meaning(BREAD[1]["content"], k=2)] == ["bread", "trip"]
        assert (_indexes(later).rebuilt, _indexes(later).read) == ([], [])


def test_a_deleted_sessions_chunks_are_not_found_here_or_by_the_next_process(tmp_path, tiny_loaded, embedder):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as db:
        for i in range(3):
            _embedded(
                db,
                messages=[{"role": "user", "content": f"Trip number {i}: " + TRIP[0]["content"]}],
                name=f"trip{i}",
                keep=SEMANTIC,
            )
        _embedded(db, messages=BREAD, name="bread", keep=SEMANTIC)
        assert db.search_meaning(BREAD[1]["content"], k=1)[0].name == "bread"
        db.delete("bread")
        assert "bread" not in {h.name for h in db.search_meaning(BREAD[1]["content"], k=10)}
        assert _indexes(db).rebuilt == [embedder.embedder_id]  # the dead rows became tombstones
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as db:
        assert {h.name for h in db.search_meaning(BREAD[1]["content"], k=10)} == {"trip0", "trip1", "trip2"}


def test_a_split_by_another_writer_keeps_both_branches_found(tmp_path, tiny_loaded, embedder):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as first:
        _embedded(first, messages=[*TRIP, {"role": "user", "content": "And in winter?"}], name="winter", keep=SEMANTIC)
        assert first.search_meaning("And in winter?", k=1)[0].name == "winter"
        had = _chunk_nodes(first)
        first._storage.release()  # as another process would find it: not held
        with kvdb.open(
            path, model=tiny_loaded, embedder=embedder
        ) as second:  # splits winter's node inside the shared turns
            _embedded(
                second, messages=[*TRIP, {"role": "user", "content": "What should I pack?"}], name="pack", keep=SEMANTIC
            )
        moved = _chunk_nodes(first) - had
        assert moved and first.search_meaning("What should I pack?", k=1)[0].name == "pack"
        assert first.search_meaning("And in winter?", k=1)[0].name == "winter"
        assert {h.name for h in first.search_meaning(TRIP[1]["content"], k=5)} == {"winter", "pack"}
        assert _indexes(first).rebuilt == [embedder.embedder_id] and moved <= set(_indexes(first).read)


@pytest.mark.parametrize("damage", [b"", b"not an index", "cut"])
def test_a_missing_or_damaged_sidecar_is_built_again(tmp_path, tiny_loaded, embedder, damage):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as db:
        _embedded(db, messages=TRIP, name="trip", keep=SEMANTIC)
        db.search_meaning("walking", k=1)
        sidecar = _indexes(db).path(embedder.embedder_id)
    whole = sidecar.read_bytes()
    if damage == "cut":
        sidecar.write_bytes(whole[: len(whole) - 64])
    elif damage:
        sidecar.write_bytes(damage)
    else:
        sidecar.unlink()
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as db:
        assert db.search_meaning(TRIP[1]["content"], k=1)[0].name == "trip"
        assert _indexes(db).rebuilt == [embedder.embedder_id] and sidecar.read_bytes() == whole


def test_repair_rebuilds_the_semantic_index_and_verify_checks_it(tmp_path, tiny_loaded, embedder):
    with kvdb.open(tmp_path / "a.duckdb", model=tiny_loaded, embedder=embedder) as db:
        _embedded(db, messages=TRIP, name="trip", keep=SEMANTIC)
        sidecar = _indexes(db).path(embedder.embedder_id)
        assert not sidecar.exists()  # derived on first use, not by the write
        report = db.verify()
        assert report.ok and report.checked["semantic indexes"] == 1 and sidecar.exists()
        assert any("semantic index" in note and "rebuilt" in note for note in report.notes)
        sidecar.write_bytes(b"damaged")
        repaired = db.repair()
        assert repaired.ok and f"semantic {embedder.embedder_id}" in repaired.rebuilt_indexes
        assert (
            _indexes(db).rebuilt == [embedder.embedder_id] * 2
            and db.search_meaning(TRIP[1]["content"], k=1)[0].name == "trip"
        )


def test_a_small_catch_up_is_not_saved_until_it_is_worth_it_and_verify_writes_it(
    tmp_path, tiny_loaded, embedder, monkeypatch
):
    from kvdb.services import semantic_tier

    monkeypatch.setattr(semantic_tier, "SAVE_SHARE", 1.0)  # save once the rows changed since the file equal all of them
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as db:
        for i in range(3):
            _embedded(
                db,
                messages=[{"role": "user", "content": f"Trip number {i}: " + TRIP[0]["content"]}],
                name=f"trip{i}",
                keep=SEMANTIC,
            )
        db.search_meaning("walking", k=1)
        sidecar = _indexes(db).path(embedder.embedder_id)
        written = sidecar.read_bytes()
        _embedded(db, messages=BREAD, name="bread", keep=SEMANTIC)
        assert db.search_meaning(BREAD[1]["content"], k=1)[0].name == "bread" and sidecar.read_bytes() == written
    with kvdb.open(path, model=tiny_loaded, embedder=embedder) as db:
        assert db.search_meaning(BREAD[1]["content"], k=1)[0].name == "bread"  # caught up again from the older file
        assert _indexes(db).rebuilt == [] and _indexes(db).read and sidecar.read_bytes() == written
        assert db.verify().ok and sidecar.read_bytes() != written  # verify writes what it caught up


# the fusion and its scores (decision 0058) ------------------------------------------------------

COMMUTE = [  # the query's words said across turns, none of them two in one turn
    {"role": "user", "content": "Each morning I take the ferry across the bay."},
    {"role": "assistant", "content": "The ferry is a calm way to start."},
    {"role": "user", "content": "Then I ride my bicycle from the pier."},
    {"role": "assistant", "content": "A bicycle ride after the crossing, then."},
    {"role": "user", "content": "The timetable changed last week."},
    {"role": "assistant", "content": "A new timetable each season; the racks fill up."},
]
HOBBY = [  # two of the query's words in one turn
    {"role": "user", "content": "I painted a ferry and a bicycle."},
    {"role": "assistant", "content": "Nice subjects for a painting."},
]


def test_a_session_found_by_its_whole_words_lands_on_its_best_chunk(db, monkeypatch):
    from kvdb.services import semantic_tier

    _embedded(db, messages=COMMUTE, name="commute", keep=SEMANTIC)
    _embedded(db, messages=HOBBY, name="hobby", keep=SEMANTIC)
    query = "ferry bicycle timetable"
    monkeypatch.setattr(semantic_tier, "WEIGHTS", (0.0, 1.0, 0.0))  # chunk words alone: the turn holding two words wins
    assert [h.name for h in db.search_meaning(query, k=2)] == ["hobby", "commute"]
    monkeypatch.setattr(
        semantic_tier, "WEIGHTS", (0.0, 0.1, 0.9)
    )  # the session's words: commute says all three, over and over
    commute, hobby = db.search_meaning(query, k=2)
    assert (commute.name, hobby.name) == ("commute", "hobby") and commute.session_words > hobby.session_words
    spans = {(row[2], row[3]) for row in chunk_rows(db)}
    assert (commute.position, commute.position + commute.match_tokens) in spans  # a chunk's span: it restores there
    assert "timetable" in commute.match  # the session's chunk the query best meets (its rarest word), not its first
    assert db.restore("commute", at=commute.position, mode="exact").position == commute.position
    only = db.search_meaning(query, k=5, session="commute")  # scoped: its chunks, and its words alone
    assert [h.name for h in only] == ["commute"] and (
        only[0].position,
        only[0].position + only[0].match_tokens,
    ) in spans


def test_the_score_is_the_weighted_parts_on_one_scale_and_weak_below_the_cut_off(db, monkeypatch, tiny_model, tmp_path):
    from kvdb.services import semantic_tier

    _embedded(db, messages=COMMUTE, name="commute", keep=SEMANTIC)
    _embedded(db, messages=BREAD, name="bread", keep=SEMANTIC)
    first, second = db.search_meaning("ferry bicycle timetable", k=2)
    for hit in (first, second):  # no part scaled over the list: the score is what the parts say, for any list
        assert hit.score == pytest.approx(
            np.dot(semantic_tier.WEIGHTS, (hit.cosine, hit.words, hit.session_words)), abs=1e-6
        )
        assert 0 <= hit.words < 1 and 0 <= hit.session_words < 1 and -1 <= hit.cosine <= 1
    assert second.words == second.session_words == 0  # bread says none of the words: no list of hits gives it a share
    nothing = db.search_meaning("quantum chromodynamics gluon plasma", k=1)[0]
    assert nothing.words == nothing.session_words == 0 and nothing.score < first.score
    monkeypatch.setattr(semantic_tier, "WEAK_BELOW", (first.score + second.score) / 2)
    marked = db.search_meaning("ferry bicycle timetable", k=2)
    assert [h.weak for h in marked] == [False, True] and [h.to_dict()["weak"] for h in marked] == [False, True]
    assert marked[0].to_dict()["score"] == round(first.score, 4)


def test_the_command_line_and_mcp_give_the_archives_scores_and_marks(tmp_path, tiny_model):
    import anyio

    from kvdb.mcp.tools import build, make_call

    env = {"KVDB_MODEL": tiny_model, "KVDB_EMBEDDER": tiny_model}
    where = tmp_path / "c.duckdb"
    for name, talk in (("commute", COMMUTE), ("bread", BREAD)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"messages": talk}))
        assert (
            CliRunner()
            .invoke(main, ["--db", str(where), "ingest", str(tmp_path / f"{name}.json"), "--keep", SEMANTIC], env=env)
            .exit_code
            == 0
        )
    assert CliRunner().invoke(main, ["--db", str(where), "upkeep", "--only", "semantic"], env=env).exit_code == 0
    query = "ferry bicycle timetable"
    printed = CliRunner().invoke(main, ["--db", str(where), "search", "--semantic", query, "--json"], env=env)
    lines = [json.loads(x) for x in printed.stdout.splitlines()]
    with kvdb.open(where, model=tiny_model, embedder=tiny_model, read_only=True) as archive:
        hits = [h.to_dict() for h in archive.search_meaning(query, k=10)]
        result = anyio.run(build(make_call(archive)).call_tool, "search", {"query": query, "semantic": True})
    assert lines == hits and {"score", "weak", "cosine"} <= set(hits[0])
    assert json.loads(result.content[0].text)["hits"] == hits
