"""The `--json` objects of the commands whose results became typed records: keys, their order and
their value types are pinned to what each command printed while the library still handed back
dicts, so scripts reading them see no change."""

import json

import pytest
from click.testing import CliRunner
from support import CALIBRATION, KV, write

from kvdb.cli.main import main

# what each command printed before its result became a record: key -> JSON type, in order
SHAPES = {
    "codebooks train": {"codebook_id": str, "preset": str, "tokens": int, "bytes": int, "seconds": float},
    "codebooks build": {"model_id": str, "preset": str, "bytes": int, "built": bool, "path": str, "seconds": float},
    "restore --fidelity": {"top1_agreement": float, "ppl_ratio": float, "probe_tokens": int},
    "index rebuild": {"index_key": str, "sessions": int, "nodes": int, "points": int, "seconds": float},
    "verify": {"ok": bool, "checked": dict, "problems": list, "notes": list},
    "repair": {"rebuilt_indexes": list, "pruned_prefix_cache_entries": int, "unrepairable": list, "ok": bool},
    "copy": {"source": str, "target": str, "rows": dict, "sha256": dict},
    "compact": {"session_id": str, "name": str, "keep": str, "status": str},
    "delete": {"session_id": str, "name": str, "status": str},
    # the file rewritten smaller; then nothing left to give back
    "gc": {
        "nodes": int,
        "tokens": int,
        "token_bytes": int,
        "prefix_cache_entries": int,
        "renumbered_indexes": list,
        "file_bytes_before": int,
        "file_bytes": int,
        "forgotten": int,  # deleted sessions whose bytes it erased (issue 55)
    },
    "gc again": {
        "nodes": int,
        "tokens": int,
        "token_bytes": int,
        "prefix_cache_entries": int,
        "renumbered_indexes": list,
        "file_bytes": int,
        "forgotten": int,
    },
}


@pytest.fixture(scope="module")
def printed(tmp_path_factory, tiny_model):
    """Each command's --json object, from one archive taken through all of them."""
    tmp = tmp_path_factory.mktemp("shapes")
    runner = CliRunner()
    env = {"KVDB_MODEL": tiny_model, "KVDB_CACHE": str(tmp / "cache")}

    def run(*args):
        result = runner.invoke(main, ["--db", str(tmp / "a.duckdb"), *args, "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.splitlines()[-1])

    run("ingest", str(write(tmp / "calibration.txt", CALIBRATION)))
    out = {"codebooks train": run("codebooks", "train", "--preset", "k2v1", "--tokens", "2000")}
    run(
        "ingest",
        str(write(tmp / "s.txt", CALIBRATION[:200] + " and a session of its own, with tier K.")),
        "--keep",
        KV,
        "--kv-preset",
        "k2v1",
    )
    out["restore --fidelity"] = run("restore", "s", "--mode", "archive", "--fidelity", "--max-new-tokens", "1")[
        "fidelity"
    ]
    out["index rebuild"] = run("index", "rebuild")
    out["verify"] = run("verify")
    out["repair"] = run("repair")
    out["compact"] = run("compact", "s", "--keep", "tokens,search")
    out["delete"] = run("delete", "s")
    out["gc"] = run("gc")
    out["gc again"] = run("gc")
    copied = runner.invoke(main, ["copy", str(tmp / "a.duckdb"), str(tmp / "b.duckdb"), "--json"], env=env)
    assert copied.exit_code == 0, copied.output
    out["copy"] = json.loads(copied.stdout)
    return out


@pytest.mark.parametrize("command", [c for c in SHAPES if c != "codebooks build"])
def test_json_keys_and_types_are_as_before(printed, command):
    obj = printed[command]
    assert list(obj) == list(SHAPES[command])
    assert {k: type(v) for k, v in obj.items()} == SHAPES[command]


def test_compact_and_delete_print_what_they_did(printed):
    assert printed["compact"]["keep"] == "tokens,search" and printed["compact"]["status"] == "compacted"
    assert printed["delete"]["status"] == "deleted" and printed["delete"]["name"] == "s"


@pytest.mark.slow
def test_codebooks_build_json_is_as_before(tmp_path, tiny_model):
    env = {"KVDB_MODEL": tiny_model, "KVDB_CACHE": str(tmp_path / "cache")}
    result = CliRunner().invoke(main, ["--db", str(tmp_path / "a.duckdb"), "codebooks", "build", "--json"], env=env)
    assert result.exit_code == 0, result.output
    obj = json.loads(result.stdout.splitlines()[-1])
    assert list(obj) == list(SHAPES["codebooks build"])
    assert {k: type(v) for k, v in obj.items()} == SHAPES["codebooks build"]
