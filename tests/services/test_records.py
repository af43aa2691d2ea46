"""The records the Archive hands back: typed, equal to the strings and dicts they replaced, and
readable as those dicts for one more release (with a DeprecationWarning)."""

import json
import warnings

import pytest

from kvdb.records import Compacted, Deleted, GcReport, IngestResult, IngestStatus, RepairReport, Session
from kvdb.tiers import TIERS, RestoreMode, Tier, parse_keep


def test_reading_a_record_as_its_old_dict_still_works_and_warns(archive):
    archive.ingest(text="A session to delete, so that gc frees its node.", name="s")
    archive.delete("s")
    freed = archive.gc()
    assert isinstance(freed, GcReport) and freed.nodes == 1
    with pytest.warns(DeprecationWarning, match=r"GcReport as a dict \(\['nodes'\]\).*attributes"):
        assert freed["nodes"] == 1
    with pytest.warns(DeprecationWarning):
        assert "file_bytes" in freed and "data_files_merged" not in freed
    with pytest.warns(DeprecationWarning):
        assert freed.get("data_files_merged", "none") == "none"
    with pytest.warns(DeprecationWarning):
        assert dict(freed) == freed.to_dict()
    with pytest.warns(DeprecationWarning):
        assert set(freed) == set(freed.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # attributes and to_dict() are the way on: no warning
        assert freed.to_dict()["nodes"] == freed.nodes


def test_a_missing_key_is_a_key_error_as_it_was():
    report = RepairReport(("idx",), 0, ())
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        report["no such key"]
    assert report.ok and report.to_dict() == {
        "rebuilt_indexes": ["idx"],
        "pruned_prefix_cache_entries": 0,
        "unrepairable": [],
        "ok": True,
    }


def test_gc_leaves_out_what_the_storage_does_not_report():
    freed = GcReport(1, 2, 3, 0, (), data_files_merged=4, data_files_written=1, data_files_deleted=0)
    assert list(freed.to_dict()) == [
        "nodes",
        "tokens",
        "token_bytes",
        "prefix_cache_entries",
        "renumbered_indexes",
        *["data_files_merged", "data_files_written", "data_files_deleted"],
        "forgotten",
    ]


def test_delete_and_compact_records_are_the_session_they_changed(archive):
    archive.ingest(text="A session whose search tier is dropped, then deleted.", name="s")
    session = archive.session("s")
    compacted = archive.compact("s", "search, tokens")
    assert isinstance(compacted, Compacted) and isinstance(compacted, Session) and compacted == session
    assert compacted.keep == (Tier.TOKENS, Tier.SEARCH) and compacted.status == "compacted"
    assert compacted.to_dict() == {
        "session_id": session.session_id,
        "name": "s",
        "keep": "tokens,search",
        "status": "compacted",
    }
    deleted = session.delete()
    assert isinstance(deleted, Deleted) and deleted == session and deleted.status == "deleted"
    assert deleted.to_dict() == {"session_id": session.session_id, "name": "s", "status": "deleted"}


def test_enums_are_their_old_strings_everywhere_a_string_went():
    result = IngestResult(None, "n", "s.txt", 0, "failed", "bad")  # a name given as a string is taken as its member
    assert result.status is IngestStatus.FAILED and result.status == "failed" and f"{result.status}" == "failed"
    assert json.dumps(result.to_dict()["status"]) == '"failed"' and type(result.to_dict()["status"]) is str
    with pytest.raises(ValueError):
        IngestResult(None, "n", "s.txt", 0, "lost")
    assert TIERS == ("tokens", "search", "lm", "kv", "semantic") and all(
        type(t) is str for t in TIERS
    )  # click lists these
    assert parse_keep("tokens,search") == {"tokens", "search"} == {Tier.TOKENS, Tier.SEARCH}
    assert RestoreMode("archive") == "archive" and ", ".join(RestoreMode) == "auto, exact, archive, decode"


def test_a_restore_says_its_mode_as_a_member(archive):
    archive.ingest(text="A session restored exactly.", name="s")
    restored = archive.restore("s", mode="exact")
    assert restored.mode is RestoreMode.EXACT and restored.to_dict()["mode"] == "exact"
