"""The archive kvdb 0.1.0 wrote (tests/fixtures/archive_v0_1_0) opens with today's kvdb, through
the public API, and gives back what 0.1.0 recorded in its expected.json: every session's
tokens and text, the search hits, the restores by each tier, a clean deep verify.

The folder is copied first: opening may migrate, and the committed files must stay as 0.1.0
wrote them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kvdb

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "archive_v0_1_0"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))


@pytest.fixture
def folder(tmp_path) -> Path:
    copy = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return copy


def open_copy(folder: Path, read_only: bool = False) -> kvdb.Archive:
    return kvdb.open(folder / "archive.duckdb", model=str(folder / "model"), read_only=read_only)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokens_sha256(ids: np.ndarray) -> str:
    return sha256(np.asarray(ids, dtype="<i4").tobytes())


@pytest.mark.parametrize("read_only", [False, True])
def test_every_session_reads_back(folder, read_only):
    with open_copy(folder, read_only) as db:
        sessions = db.sessions()
        assert [(s.name, s.session_id, s.n_tokens, s.source) for s in sessions] == [
            (e["name"], e["session_id"], e["n_tokens"], e["source"]) for e in EXPECTED["sessions"]
        ]
        assert {s.model_id for s in sessions} == {EXPECTED["model_id"]}
        for s, e in zip(sessions, EXPECTED["sessions"], strict=True):
            assert sha256(db.text(s.session_id).encode()) == e["text_sha256"], s.name
            ids = db.tokens(s.session_id)
            assert len(ids) == e["n_tokens"] and tokens_sha256(ids) == e["tokens_sha256"], s.name
            assert db.session(s.name).session_id == e["session_id"]


@pytest.mark.parametrize("read_only", [False, True])
def test_search_finds_what_it_found(folder, read_only):
    search = EXPECTED["search"]
    with open_copy(folder, read_only) as db:
        hits = db.search(search["phrase"], k=search["k"])
    exact = [h.exact for h in hits]
    assert exact == sorted(exact, reverse=True), "full matches come first"
    assert sorted([h.name, h.session_id, h.position] for h in hits if h.exact) == search["exact_hits"]


@pytest.mark.parametrize("name", sorted(EXPECTED["restore"]))
def test_restore_continues_as_it_did(folder, name):
    """notes restores exactly (a prefill of the token tier), tier-k from its KV codes, tier-l by
    decoding its tier-L payload. Machine-dependent, like every tier-L decode: tier-l decodes only
    where the one-token forward pass computes as on the machine that wrote the fixture (see
    kvdb/model/lmcode.py), and each continuation is greedy decoding of that machine's logits."""
    expected = EXPECTED["restore"][name]
    with open_copy(folder) as db:
        restored = db.restore(name, at=expected["at"], mode=expected["mode"])
        assert (restored.mode, restored.position) == (expected["mode"], expected["position"])
        assert tokens_sha256(restored.tokens) == expected["tokens_sha256"]
        assert db.generate(restored, max_new_tokens=EXPECTED["continue_tokens"]) == expected["continuation"]


def test_its_tier_k_is_reported_by_spec_and_auto_prefills_it_exactly(folder):
    """0.1.0's codebooks were trained on the archive (k2v1, no name): nobody measured them, so
    auto prefills exactly and says so, and an archive restore still decodes them and names them."""
    with open_copy(folder, read_only=True) as db:
        auto = db.restore("tier-k")
        assert auto.mode == "exact" and auto.fidelity is None and "trained on this archive (k2v1)" in auto.reason
        archived = db.restore("tier-k", mode="archive")
        assert archived.fidelity.to_dict() == {
            "preset": None,
            "spec": "k2v1",
            "source": "trained",
            "lengths": {},
            "measured_by": None,
        }
        assert db.stats().kv_bytes_by_preset == {"k2v1": db.stats().bytes["kv"]}


def test_deep_verify_finds_nothing_wrong(folder):
    """The search sidecar 0.1.0 wrote (KVDBIDX3) is derived data of an older format: verify
    builds it again in today's (KVDBIDX4), notes that, and finds nothing else."""
    with open_copy(folder) as db:
        report = db.verify(deep=True)
        again = db.verify()
    assert report.ok, report.problems
    assert report.checked["sessions"] == len(EXPECTED["sessions"])
    assert [note.split(" was ")[1] for note in report.notes] == ["missing or disagreed with the database; rebuilt"]
    assert again.ok and not again.notes


def test_the_same_weights_as_another_architecture_are_refused(folder):
    """0.1.0 recorded no attention config, but it recorded the model type: the fixture's Llama
    weights loaded as a Mistral with a sliding window are not the model its sessions were
    computed with (exit 4)."""
    config = json.loads((folder / "model" / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16)
    (folder / "model" / "config.json").write_text(json.dumps(config))
    name = sorted(EXPECTED["restore"])[0]
    with open_copy(folder) as db:
        with pytest.raises(kvdb.KvdbError, match="was archived with model") as refused:
            db.restore(name, mode="exact")
        assert refused.value.exit_code == 4
