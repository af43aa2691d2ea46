"""benchmarks/formats.py --throughput's corpus: copies of a tool's fixtures with fresh ids read
as the fixtures do (the ids that link records are replaced together), and a tool's fixtures
that do not read whole are left out with the reason, not timed."""

import formats as F

from kvdb.transcripts import iter_transcripts


def shape(path):
    return [(len(s.messages or ()), s.dropped) for s in iter_transcripts(path, skipped=[])]


def test_copies_with_fresh_ids_read_like_their_fixture(tmp_path):
    fixture = F.EXPORTS / "claude-code" / "spotter-short.jsonl"
    original = fixture.read_bytes()
    copies = F.replicate([fixture], tmp_path, 2 * len(original))
    assert len(copies) == 2
    first, second = (set(F.UUID.findall(c.read_bytes())) for c in copies)
    assert first and not first & second and not first & set(F.UUID.findall(original))
    assert shape(copies[0]) == shape(copies[1]) == shape(fixture)


def test_only_fixtures_read_whole_are_timed(tmp_path):
    (tmp_path / "whole.jsonl").write_text(
        '{"role": "user", "content": "hi"}\n{"role": "assistant", "content": "hello"}\n'
    )
    (tmp_path / "part.jsonl").write_text('{"role": "user", "content": "hi"}\nnot json\n')
    (tmp_path / "none.json").write_text('{"neither": 1}')
    readable, unread = F.fixtures_read(tmp_path)
    assert [p.name for p in readable] == ["whole.jsonl"]
    assert sorted(why.split(":")[0] for _, why in unread) == ["none.json", "part.jsonl"]
    assert "read only in part (1 skipped" in dict((p.name, why) for p, why in unread)["part.jsonl"]
