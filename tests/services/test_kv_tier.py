"""Tier K in the archive: codebooks trained on archived sessions, codes stored per trie node,
restores built from them, the fidelity report, and stats."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from support import CALIBRATION, KV, write

from kvdb.cli.main import main
from kvdb.errors import InvalidArgument


def test_ingest_with_kv_restores_from_the_archive(kv_archive):
    [r] = kv_archive.ingest(
        text="The harbour lights were lit at dusk and the ships came home one by one.", keep=KV, name="s"
    )
    st = kv_archive.stats()
    assert st.bytes["kv"] > 0 and st.codebook_bytes == st.bytes["codebooks"] > 0
    # tiny model: 2 layers x 2 KV heads x 16 dims;
    # its balanced preset (unmeasured: k6v4) stores 10 one-byte codes per head and layer
    assert st.kv_ratio_vs_fp16 == pytest.approx((2 * 2 * 2 * 16 * 2) / st.bytes_per_token["kv"])
    assert 5 < st.kv_ratio_vs_fp16 < 2 * 2 * 16 * 2 * 2 / (10 * 2 * 2)
    assert st.kv_bytes_by_preset == {"balanced": st.bytes["kv"]}
    # codebooks trained on this archive: nothing measured them, so auto prefills exactly and says so
    auto = kv_archive.restore("s")
    assert (
        auto.mode == "exact"
        and auto.fidelity is None
        and "trained on this archive" in auto.reason
        and "nobody measured" in auto.reason
    )
    restored = kv_archive.restore("s", mode="archive")
    assert restored.mode == "archive" and restored.position == r.n_tokens and "as asked" in restored.reason
    assert (
        restored.window == "recompute"
    )  # a residual-VQ preset's default: its errors are what the recomputed window hides
    assert restored.fidelity is not None and (
        restored.fidelity.preset,
        restored.fidelity.source,
        restored.fidelity.lengths,
    ) == ("balanced", "trained", {})
    report = kv_archive.fidelity("s")
    assert set(report.to_dict()) == {"top1_agreement", "ppl_ratio", "probe_tokens"} and report.probe_tokens == 32
    assert 0 <= report.top1_agreement <= 1 and report.ppl_ratio > 0


def test_short_prefix_is_all_exact_window(kv_archive):
    """Recomputed, the sinks (4) and the recent window (32) make a 36-token restore exact."""
    [r] = kv_archive.ingest(text="A short session with under forty tokens.", keep=KV, name="short")
    ids = kv_archive.tokens("short")
    assert len(ids) > 36
    archived = kv_archive.restore("short", at=36, mode="archive", window="recompute")
    with torch.no_grad():
        step = archived.model(torch.as_tensor(ids[36:37])[None], cache=archived.cache).logits[0, -1]
        fresh = archived.model(torch.as_tensor(ids[:37])[None]).logits[0, -1]
    torch.testing.assert_close(step, fresh, atol=1e-4, rtol=1e-4)


def test_the_stored_window_takes_exact_sinks_kept_once_per_opening(kv_archive):
    """No forward pass over the session: the sinks come exact from this machine's cache of
    them, one entry for every session that opens with the same tokens."""
    opening = "Every session here opens alike, "
    for name, rest in (
        ("one", "then says one thing at some length, to have a middle."),
        ("two", "and then another, of about the same length again."),
    ):
        kv_archive.ingest(text=opening + rest, keep=KV, name=name)
    for name in ("one", "two"):
        restored = kv_archive.restore(name, mode="archive", window="stored")
        exact = kv_archive.restore(name, mode="exact")
        for got, want in zip(restored.cache.layers, exact.cache.layers):
            torch.testing.assert_close(got.keys[:, :, :4], want.keys[:, :, :4], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values[:, :, :4], want.values[:, :, :4], atol=1e-5, rtol=1e-5)
        assert restored.cache.get_seq_length() == len(restored.tokens) == len(kv_archive.tokens(name))
    assert len(list(kv_archive.local_path(".sinks").glob("*.kv"))) == 1
    with pytest.raises(InvalidArgument, match="unknown window"):
        kv_archive.restore("one", mode="archive", window="fp16")


def test_shared_prefix_and_split_keep_codes_per_node(kv_archive):
    head = "A common opening that two sessions share, long enough to be quantized. "
    kv_archive.ingest(text=head + "Then the first one ends here.", keep=KV, name="a")
    kv_archive.ingest(text=head + "But the second goes elsewhere.", keep=KV, name="b")  # cuts a's node
    for name in ("a", "b"):
        restored = kv_archive.restore(name, mode="archive")
        np.testing.assert_array_equal(restored.tokens, kv_archive.tokens(name))
        assert restored.cache.get_seq_length() == len(restored.tokens)


def test_a_stored_window_restore_is_the_stored_codes_decoded_and_rotated(kv_archive):
    """Past the exact sinks, the restored cache holds exactly what the stored codes decode to,
    rotated to its positions: over one node, and over a path the second session split in two."""
    from kvdb.codecs import code_layout, quant
    from kvdb.model import capture

    head = "A common opening that two sessions share, long enough to be quantized. "
    kv_archive.ingest(text=head + "Then the first one ends here, after a while.", keep=KV, name="a")
    kv_archive.ingest(text=head + "But the second goes elsewhere entirely.", keep=KV, name="b")
    storage, tier_k = kv_archive._storage, kv_archive._tier_k
    for name in ("a", "b"):
        restored = kv_archive.restore(name, mode="archive", window="stored")
        nodes = storage.node_path(kv_archive.session(name).session_id)
        assert len(nodes) == 2
        keys, values = [], []
        for node in nodes:
            codebook_id, streams = storage.node_kv(node.node_id)
            books = tier_k.codebooks(node.model_id, codebook_id)[1]
            k, v = quant.decode(books, code_layout.codes_from_streams(books, streams, node.n_tokens))
            keys.append(k)
            values.append(v)
        want_k = capture.apply_rope(restored.model, np.concatenate(keys, axis=2))
        want_v = np.concatenate(values, axis=2)
        got_k, got_v = capture.cache_arrays(restored.cache)
        np.testing.assert_allclose(got_k[:, :, capture.SINKS :], want_k[:, :, capture.SINKS :], atol=1e-5)
        np.testing.assert_array_equal(got_v[:, :, capture.SINKS :], want_v[:, :, capture.SINKS :])


def test_a_restore_sharpens_keys_by_the_models_measured_factor(kv_archive, monkeypatch):
    """The model's factor (here set for the tiny model) moves each restored key away from its
    head's centre, the mean of its first-stage centroids; values and the stored codebooks stay
    as trained."""
    from kvdb.codecs import code_layout, presets, quant
    from kvdb.model import capture

    weights = kv_archive._models.get().identity.weights_hash
    monkeypatch.setitem(presets.MEASURED_KEY_SHARPENING, weights, 1.5)
    kv_archive.ingest(
        text="A session long enough to be quantized past its sinks, and then some more words.", keep=KV, name="a"
    )
    restored = kv_archive.restore("a", mode="archive", window="stored")
    [node] = kv_archive._storage.node_path(kv_archive.session("a").session_id)
    codebook_id, streams = kv_archive._storage.node_kv(node.node_id)
    books = kv_archive._tier_k.codebooks(node.model_id, codebook_id)[1]
    assert "sharpened" not in books.meta
    k, v = quant.decode(books, code_layout.codes_from_streams(books, streams, node.n_tokens))
    centre = np.stack([layer[0].mean(1) for layer in books.books["k"]])[:, :, None, :]  # [layers, heads, 1, dim]
    got_k, got_v = capture.cache_arrays(restored.cache)
    want_k = capture.apply_rope(restored.model, centre + 1.5 * (k - centre))
    np.testing.assert_allclose(got_k[:, :, capture.SINKS :], want_k[:, :, capture.SINKS :], atol=1e-4)
    np.testing.assert_array_equal(got_v[:, :, capture.SINKS :], v[:, :, capture.SINKS :])
    assert (
        np.abs(got_k[:, :, capture.SINKS :] - capture.apply_rope(restored.model, k)[:, :, capture.SINKS :]).max() > 1e-2
    )


def test_without_tier_k(archive):
    archive.ingest(text="plain session", name="plain")
    assert archive.restore("plain").mode == "exact"
    with pytest.raises(InvalidArgument, match="no tier K"):
        archive.restore("plain", mode="archive")
    with pytest.raises(InvalidArgument, match="archived positions"):
        archive.train_codebooks(preset="k2v1", tokens=5000)
    for bare in ("k2v0", "k2v1+k0@1", "k2v1+k0@1.0"):  # a head without codes would restore as zeros
        with pytest.raises(InvalidArgument, match="no stages"):
            archive.train_codebooks(preset=bare)


def test_compact_drops_tier_k(kv_archive):
    kv_archive.ingest(text="Compact this session's KV codes away, keep its tokens.", keep=KV, name="c")
    kv_archive.compact("c", "tokens,search")
    assert kv_archive.restore("c").mode == "exact"
    assert kv_archive.stats().bytes["kv"] == 0


def test_cli_codebooks_restore_archive_fidelity(tmp_path, tiny_model):
    write(tmp_path / "calibration.txt", CALIBRATION)
    write(tmp_path / "later.txt", "A later session, archived with its quantized KV cache for a fast restore.")
    runner = CliRunner()
    base = ["--db", str(tmp_path / "c.duckdb")]
    env = {"KVDB_MODEL": tiny_model}
    assert runner.invoke(main, [*base, "ingest", str(tmp_path / "calibration.txt")], env=env).exit_code == 0
    trained = runner.invoke(
        main, [*base, "codebooks", "train", "--preset", "k2v1", "--tokens", "2000", "--json"], env=env
    )
    assert trained.exit_code == 0 and json.loads(trained.stdout)["preset"] == "k2v1"
    assert (
        runner.invoke(
            main, [*base, "ingest", str(tmp_path / "later.txt"), "--keep", KV, "--kv-preset", "k2v1"], env=env
        ).exit_code
        == 0
    )
    out = runner.invoke(
        main, [*base, "restore", "later", "--mode", "archive", "--fidelity", "--max-new-tokens", "2", "--json"], env=env
    )
    assert out.exit_code == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["mode"] == "archive" and set(row["fidelity"]) == {"top1_agreement", "ppl_ratio", "probe_tokens"}
    assert row["preset_fidelity"] == {
        "preset": None,
        "spec": "k2v1",
        "source": "trained",
        "lengths": {},
        "measured_by": None,
    }
    assert "as asked" in row["reason"] and "not measured" in row["reason"]
    auto = runner.invoke(main, [*base, "restore", "later", "--max-new-tokens", "1", "--json"], env=env)
    assert (
        auto.exit_code == 0
        and json.loads(auto.stdout)["mode"] == "exact"
        and json.loads(auto.stdout)["preset_fidelity"] is None
    )
    refused = runner.invoke(main, [*base, "restore", "later", "--max-loss", "0.9"], env=env)
    assert refused.exit_code != 0 and "at least 1.0" in refused.stderr
    stats = json.loads(runner.invoke(main, [*base, "stats", "--json"], env=env).stdout)
    assert stats["bytes_per_token"]["kv"] > 0 and stats["kv_ratio_vs_fp16"] > 1 and stats["codebook_bytes"] > 0


def test_shared_prefix_stored_without_kv_gets_it(kv_archive):
    opening = "An opening line archived first without tier K. "
    kv_archive.ingest(text=opening + "Plain ending.", name="plain")
    kv_archive.ingest(text=opening + "An ending that wants a fast restore.", keep=KV, name="fast")
    assert (
        kv_archive.restore("fast", mode="archive").mode == "archive"
    )  # refused were a node of its path without tier K
    plain = kv_archive.restore("plain")  # its own tail node still has no tier K
    assert plain.mode == "exact" and plain.reason.startswith("not every token restored has tier K")
    assert kv_archive.verify(deep=True).ok


def test_reingest_after_delete_asks_for_kv_again(kv_archive):
    text = "Deleted, then archived again with tier K before gc ran."
    kv_archive.ingest(text=text, name="again")
    kv_archive.delete("again")
    kv_archive.ingest(text=text, keep=KV, name="again")  # the node still exists: no new tokens, no scoring
    assert kv_archive.restore("again", mode="archive").mode == "archive"
