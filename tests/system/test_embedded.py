"""Integration on the embedded SmolLM2-135M-Instruct: exact text round trip and exact restores."""

import numpy as np
import pytest
import torch

import kvdb
from kvdb.codecs import presets
from kvdb.model.source import DEFAULT_MODEL

pytestmark = pytest.mark.model

UNICODE_TEXT = (
    "Ünïcödé test — «quotes», naïve café, Straße, 東京の春、한국어 텍스트, emoji 🚀🧪 and math ∑∫≈≠.\n"
    "Tabs\tand  double  spaces, CRLF line\r\n"
    "def f(x):\n    return {'k': [x, x ** 2]}  # code\n"
)


@pytest.fixture(scope="module")
def db(tmp_path_factory, embedded):
    with kvdb.open(
        tmp_path_factory.mktemp("emb") / "a.duckdb", model=embedded
    ) as archive:  # the session's loaded model, shared
        yield archive


def test_identity_is_recorded(db):
    identity = db.loaded_model.identity
    assert identity.name == DEFAULT_MODEL
    assert identity.config["num_hidden_layers"] == 30 and identity.config["vocab_size"] == 49152
    assert len(identity.weights_hash) == 64 and len(identity.tokenizer_hash) == 64


def test_a_request_naming_no_sampling_samples_as_the_model_card_says(db):
    from kvdb.serving import Sampling
    from kvdb.serving.generation import model_sampling

    assert model_sampling(db.loaded_model) == Sampling(temperature=0.2, top_p=0.9)  # not 1.0: gibberish at that


def test_unicode_text_round_trips_byte_exact(db, tmp_path):
    path = tmp_path / "unicode.md"
    path.write_bytes(UNICODE_TEXT.encode("utf-8"))
    [result] = db.ingest(path)
    assert result.status == "ingested"
    assert db.text(result.session_id).encode("utf-8") == UNICODE_TEXT.encode("utf-8")
    assert "text" not in db.session(result.session_id).metadata  # exact through the tokens alone


def test_restore_equals_fresh_prefill(db):
    [result] = db.ingest(
        messages=[
            {"role": "user", "content": "Name three planets."},
            {"role": "assistant", "content": "Mercury, Venus and Earth."},
        ]
    )
    ids = db.tokens(result.session_id)
    restored = db.restore(result.session_id, at=len(ids) - 1)
    with torch.no_grad():
        step = restored.model(torch.as_tensor(ids[-1:])[None], cache=restored.cache).logits[0, -1]
        fresh = restored.model(torch.as_tensor(ids)[None]).logits[0, -1]
    torch.testing.assert_close(step, fresh, atol=2e-4, rtol=1e-4)
    assert int(step.argmax()) == int(fresh.argmax())


def test_continue_a_chat(db):
    [result] = db.ingest(
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    )
    reply = db.continue_session(result.session_id, prompt="And of Italy?", max_new_tokens=12)
    assert "Rome" in reply


def test_stored_logprobs_give_sane_cross_entropy(db):
    text = (
        "The quick brown fox jumps over the lazy dog. Licensed under the Apache License, Version 2.0; "
        "you may not use this file except in compliance with the License."
    )
    [result] = db.ingest(text=text)
    bits = -db.logprobs(result.session_id)[1:] / np.log(2)
    assert 0.5 < bits.mean() < 8.0


def test_every_format_ingests_and_show_and_search_hold_only_what_the_transcripts_hold(db):
    """SmolLM2's template writes "You are a helpful AI assistant named SmolLM…" when a chat has no
    system turn: it is rendered as an empty system turn instead (decision 0018)."""
    from support import EXAMPLES

    results = db.ingest(EXAMPLES)
    assert {r.status for r in results} <= {"ingested", "unchanged"} and len(results) >= 17
    by_name = {r.name: r for r in results}
    assert by_name["anthropic"].dropped == {"image": 1}
    assert by_name["anthropic"].to_dict()["dropped"] == {"image": 1}
    for result in results:
        text = db.text(result.session_id)
        assert "SmolLM" not in text and "helpful AI assistant" not in text, result.name
    assert not [h for h in db.search("a helpful AI assistant named SmolLM") if not h.partial]
    [hit] = [h for h in db.search("12 rows") if not h.partial]
    assert hit.session_id == by_name["anthropic"].session_id
    assert '<tool_call id="toolu_01A" name="count_rows">{"image": 0}</tool_call>' in db.text(hit.session_id)


def test_tier_k_works_out_of_the_box_with_the_shipped_codebooks(db):
    """No training step: the first `--keep kv` ingest builds kvdb's own codebooks (once per
    machine: minutes on 2 cores, the first time) and the archive stores only a reference."""
    import argparse

    # text kvdb's calibration does not hold; compact, the preset whose build time and ratio are measured
    [result] = db.ingest(text=argparse.__doc__, name="shipped", keep="tokens,search,kv", kv_preset="compact")
    [books] = db.codebooks()
    assert (
        books.source == "shipped"
        and books.preset == presets.MEASURED_PRESETS[db.loaded_model.identity.weights_hash]["compact"]
    )
    assert books.stored_bytes < 512 < 10e6 < books.centroid_bytes
    st = db.stats()
    assert (
        st.codebook_bytes == books.stored_bytes
        and st.shipped_codebook_bytes == books.centroid_bytes
        and st.kv_ratio_vs_fp16 > 30
    )
    restored = db.restore("shipped", mode="archive")
    assert restored.mode == "archive" and restored.cache.get_seq_length() == result.n_tokens
    report = db.fidelity("shipped", at=result.n_tokens - 32)
    assert report.probe_tokens == 32 and report.ppl_ratio < 1.3 and report.top1_agreement > 0.6, report
