"""The Python API end to end on a tiny random Llama: ingest, read back, restore, continue, delete."""

import numpy as np
import pytest
import torch
from support import write, write_jsonl

import kvdb
from kvdb.codecs import fractal
from kvdb.errors import (
    AmbiguousSession,
    InvalidArgument,
    ModelMismatch,
    ModelNotFound,
    SessionNotFound,
    TranscriptError,
)
from kvdb.model import chat
from kvdb.model import loading as lm_ops
from kvdb.model import tokenizer as tok
from kvdb.services import ingesting
from kvdb.storage.sql import STREAM_ROW_BYTES

TEXT = "Héllo wörld — naïve café ☕, 日本語 and an emoji 🚀.\r\nSecond line\n"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]


def test_ingest_text_is_shown_back_exactly(archive):
    [result] = archive.ingest(text=TEXT, name="greeting")
    assert result.status == "ingested" and result.name == "greeting"
    assert archive.text("greeting") == TEXT
    session = archive.session("greeting")
    assert session.n_tokens == result.n_tokens == len(TEXT.encode())  # byte-level tokenizer: one token per byte
    assert archive.sessions() == [session]


def test_ingest_is_idempotent(archive):
    first = archive.ingest(text=TEXT)
    again = archive.ingest(text=TEXT, name="other name")
    assert [r.status for r in again] == ["unchanged"]
    assert again[0].session_id == first[0].session_id
    assert len(archive.sessions()) == 1


def test_messages_are_rendered_with_chat_template(archive):
    [result] = archive.ingest(messages=MESSAGES, name="math")
    rendered = chat.render(archive.loaded_model.tokenizer, MESSAGES)
    assert archive.text(result.session_id) == rendered
    assert archive.session("math").metadata["kind"] == "chat"


def test_files_and_directories(archive, tmp_path):
    write(tmp_path / "in" / "a.txt", "alpha text\n")
    write_jsonl(tmp_path / "in" / "deep" / "b.jsonl", MESSAGES)
    write(tmp_path / "in" / "ignored.csv", "x,y\n")
    results = archive.ingest(tmp_path / "in")
    assert sorted(r.name for r in results) == ["a", "b"]
    assert all(r.status == "ingested" for r in results)
    assert archive.text("a") == "alpha text\n"


def test_failed_file_writes_nothing_and_others_ingest(archive, tmp_path):
    good = write(tmp_path / "good.md", "# fine\n")
    bad = write(tmp_path / "bad.jsonl", '{"role": "user", "content": "ok"}\n{"role": "user", "content": 5}\n')
    results = {r.source: r for r in archive.ingest([bad, good], strict=True)}
    assert results[str(bad)].status == "failed"
    assert "bad.jsonl:2" in results[str(bad)].error
    assert results[str(good)].status == "ingested"
    assert [s.name for s in archive.sessions()] == ["good"]
    [lenient] = archive.ingest(bad)  # by default the bad line is left out and named; the rest ingests
    assert (
        lenient.status == "ingested"
        and [s["line"] for s in lenient.skipped] == [2]
        and "must be a string" in lenient.skipped[0]["reason"]
    )


def test_a_bad_session_late_in_a_file_writes_none_of_the_file(archive, tmp_path):
    """Files are streamed session by session, but checked whole before anything is archived."""
    sessions = [{"name": f"s{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    sessions.append({"name": "bad", "messages": [{"role": "user", "content": 5}]})
    path = write_jsonl(tmp_path / "many.jsonl", sessions)
    [result] = archive.ingest(path, strict=True)
    assert result.status == "failed" and result.error.startswith(f"{path}:4: ") and "must be a string" in result.error
    assert archive.sessions() == []
    del sessions[-1]
    write_jsonl(path, sessions)
    assert [r.status for r in archive.ingest(path)] == ["ingested"] * 3


def test_progress_announces_each_file_before_archiving_it(archive, tmp_path):
    write(tmp_path / "in" / "a.txt", "alpha text\n")
    write_jsonl(tmp_path / "in" / "b.jsonl", MESSAGES)
    calls = []
    results = archive.ingest(tmp_path / "in", progress=lambda done, planned: calls.append((done, planned)))
    sizes = [r.n_tokens for r in results]
    assert calls == [(0, sizes[0]), (sizes[0], 0), (0, sizes[1]), (sizes[1], 0)]


def test_a_huge_single_line_is_refused_without_reading_it(archive, tmp_path, monkeypatch):
    monkeypatch.setattr(ingesting, "SESSION_BYTES", 4 * 2**20)
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"messages": [{"role": "user", "content": "')
        for _ in range(100):
            f.write(b"a" * 2**20)
        f.write(b'"}]}\n')
    [result] = archive.ingest(path)
    assert result.status == "failed"
    assert (
        result.error
        == f"{path}:1: the session is larger than 4 MiB, the most one session may hold; split it into smaller sessions"
    )
    assert archive.sessions() == []


def test_api_raises_on_bad_text_input(archive):
    with pytest.raises(TranscriptError):
        archive.ingest(messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidArgument):
        archive.ingest()
    assert archive.sessions() == []


def test_logprobs_match_a_full_forward_pass(archive):
    [result] = archive.ingest(text=TEXT * 3)
    ids = archive.tokens(result.session_id)
    with torch.no_grad():
        logits = archive.loaded_model.model(torch.as_tensor(ids)[None]).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.as_tensor(ids[1:])[:, None])[:, 0].numpy()
    stored = archive.logprobs(result.session_id)
    assert stored.shape == ids.shape
    assert stored[0] == pytest.approx(-np.log(archive.loaded_model.model.config.vocab_size))
    np.testing.assert_allclose(stored[1:], expected, atol=1e-4)


def test_scoring_in_chunks_equals_one_pass(archive):
    ids = np.array(tok.encode(archive.loaded_model.tokenizer, TEXT * 4))
    whole, cache = lm_ops.score(archive.loaded_model.model, ids, chunk=4096)
    assert cache.get_seq_length() == len(ids)
    np.testing.assert_allclose(lm_ops.score(archive.loaded_model.model, ids, chunk=7)[0], whole, atol=1e-4)
    # resuming from a cache of a prefix scores the rest exactly as one pass does
    prefix = lm_ops.prefill(archive.loaded_model.model, ids[:49])
    tail, _ = lm_ops.score(archive.loaded_model.model, ids, start=50, cache=prefix, chunk=16)
    np.testing.assert_allclose(tail, whole[50:], atol=1e-4)


def test_token_ranges(archive):
    [r] = archive.ingest(text="abcdefghij")
    np.testing.assert_array_equal(archive.tokens(r.session_id, 2, 5), archive.tokens(r.session_id)[2:5])
    assert len(archive.tokens(r.session_id, 2, 5)) == 3
    assert archive.text(r.session_id, 2, 5) == "cde"
    assert archive.text(r.session_id, 5, 5) == ""
    with pytest.raises(InvalidArgument, match="outside session"):
        archive.text(r.session_id, 3, 11)
    with pytest.raises(InvalidArgument):
        archive.tokens(r.session_id, -1, 2)


def test_session_references(archive):
    a = archive.ingest(text="first", name="one")[0].session_id
    archive.ingest(text="second", name="two")
    archive.ingest(text="third", name="two")
    assert archive.session(a).name == "one"
    assert archive.session(a[:10]).session_id == a
    assert archive.session("one").session_id == a
    with pytest.raises(SessionNotFound, match="kvdb sessions"):
        archive.session("zzzz-nothing")
    with pytest.raises(AmbiguousSession, match="names 2 conversations"):
        archive.session("two")
    with pytest.raises(InvalidArgument):
        archive.session("")


def test_restored_cache_gives_fresh_prefill_logits(archive):
    [r] = archive.ingest(text=TEXT)
    ids = archive.tokens(r.session_id)
    restored = archive.restore(r.session_id, at=len(ids) - 1)
    assert restored.position == len(ids) - 1 and restored.mode == "exact"
    assert restored.cache.get_seq_length() == len(ids) - 1
    with torch.no_grad():
        step = restored.model(torch.as_tensor(ids[-1:])[None], cache=restored.cache).logits[0, -1]
        fresh = restored.model(torch.as_tensor(ids)[None]).logits[0, -1]
    torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)


def test_restored_cache_works_with_generate(archive):
    [r] = archive.ingest(text=TEXT)
    ids = archive.tokens(r.session_id)
    restored = archive.restore(r.session_id, at=10)
    new_ids = torch.as_tensor(ids[:12])[None]
    out = restored.model.generate(new_ids, cache=restored.cache, max_new_tokens=5, do_sample=False)
    reference = restored.model.generate(new_ids, max_new_tokens=5, do_sample=False)
    assert out.tolist() == reference.tolist()


def test_continue_session(archive):
    [r] = archive.ingest(messages=MESSAGES)
    reply = archive.continue_session(r.session_id, prompt="And 3+3?", max_new_tokens=5)
    assert isinstance(reply, str)
    plain = archive.continue_session(r.session_id, max_new_tokens=3, at=5)
    assert isinstance(plain, str)
    with pytest.raises(InvalidArgument, match="nothing to continue"):
        archive.continue_session(r.session_id, at=0)
    with pytest.raises(InvalidArgument):
        archive.restore(r.session_id, at=10_000)


def test_continue_matches_generation_from_scratch(archive):
    [r] = archive.ingest(text=TEXT)
    ids = archive.tokens(r.session_id)
    reply = archive.continue_session(r.session_id, prompt="xy", max_new_tokens=6)
    full = torch.as_tensor(np.concatenate([ids, tok.encode(archive.loaded_model.tokenizer, "xy")]))[None]
    ref = archive.loaded_model.model.generate(
        full, max_new_tokens=6, do_sample=False, pad_token_id=archive.loaded_model.tokenizer.eos_token_id
    )
    assert reply == archive.loaded_model.tokenizer.decode(ref[0, full.shape[1] :], skip_special_tokens=True)


def test_generate_twice_on_one_restore_continues_from_the_same_state(archive):
    """Issue 30: the second call ran on a cache the first had consumed, and answered otherwise."""
    [r] = archive.ingest(text=TEXT)
    restored = archive.restore(r.session_id)
    for prompt in ("xy", None):
        first = archive.generate(restored, prompt, max_new_tokens=6)
        assert restored.cache.get_seq_length() == restored.position
        assert archive.generate(restored, prompt, max_new_tokens=6) == first
        assert first == archive.continue_session(r.session_id, prompt=prompt, max_new_tokens=6)


def test_restore_with_another_model_is_refused(tmp_path, tiny_model, other_tiny_model):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        sid = db.ingest(text=TEXT)[0].session_id
    with kvdb.open(path, model=other_tiny_model) as db:
        with pytest.raises(ModelMismatch, match="--model"):
            db.restore(sid)


def test_missing_model_is_a_clear_error(tmp_path):
    with kvdb.open(tmp_path / "a.duckdb", model=str(tmp_path / "no-such-model")) as db:
        with pytest.raises(ModelNotFound, match="cannot load model"):
            db.ingest(text="hi")


def test_delete_and_stats(archive):
    a = archive.ingest(text="first session")[0]
    b = archive.ingest(text="second one!")[0]
    st = archive.stats()
    assert st.sessions == 2 and st.tokens == a.n_tokens + b.n_tokens
    # every stored byte of the tier: the fractal blocks (headers and CRCs included) and the stream rows
    alphabet = max(archive.loaded_model.model.config.vocab_size, len(archive.loaded_model.tokenizer))
    blocks = sum(len(blob) for r in (a, b) for blob in fractal.encode_blocks(archive.tokens(r.session_id), alphabet))
    assert st.bytes["tokens"] == blocks + 2 * STREAM_ROW_BYTES
    assert st.bytes_per_token["tokens"] == st.bytes["tokens"] / st.tokens
    # ingest ran no model: the log-probabilities wait for upkeep, which stores them whole
    assert st.bytes["logprobs"] == 0 and st.pending.logprobs == kvdb.records.Queued(2, st.tokens)
    assert archive.upkeep().scored.sessions == 2
    st = archive.stats()
    assert st.bytes["logprobs"] == 4 * st.tokens and st.pending == kvdb.records.Pending()
    assert archive.delete(a.session_id).name == a.name
    assert [s.session_id for s in archive.sessions()] == [b.session_id]
    with pytest.raises(SessionNotFound):
        archive.text(a.session_id)
    assert archive.stats().tokens == b.n_tokens


def test_reopen_keeps_sessions(tmp_path, tiny_model):
    path = tmp_path / "a.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        sid = db.ingest(text=TEXT)[0].session_id
    with kvdb.open(path, model=tiny_model) as db:
        assert db.text(sid) == TEXT


def test_a_session_handle_is_its_record_and_the_archives_calls(archive):
    """Issue 30: archive.session(ref) hands out a session as sqlite-utils hands out a Table."""
    [r] = archive.ingest(text=TEXT, name="notes")
    notes = archive.session("notes")
    assert isinstance(notes, kvdb.Session) and notes.session_id == r.session_id
    assert notes.to_dict() == next(s.to_dict() for s in archive.sessions() if s.name == "notes")
    assert notes.text() == TEXT and notes.text(0, 5) == archive.text("notes", 0, 5)
    np.testing.assert_array_equal(notes.tokens(2, 9), archive.tokens("notes", 2, 9))
    assert notes.restore(at=7).position == 7
    assert [h.to_dict() for h in notes.search(TEXT[:12])] == [
        h.to_dict() for h in archive.search(TEXT[:12], session="notes")
    ]
    assert notes.delete().session_id == r.session_id and archive.sessions() == []
