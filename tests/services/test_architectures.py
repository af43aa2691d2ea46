"""Architectures beyond Llama: tiny random models, among them ones whose sessions are longer than
their sliding window (Mistral: every layer slides; Gemma2: sliding and global layers alternate),
with no RoPE (GPT-2) and with RoPE on part of each head (GPT-NeoX, Phi3). Every layer of a cache
kvdb captures, saves, scores onto or restores must hold all positions, and keys taken back to
pre-RoPE must rotate back to exactly what the model computed."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from support import make_tiny_model

import kvdb
from kvdb.errors import ModelMismatch
from kvdb.model import loading as lm_ops
from kvdb.model.prefix_cache import PrefixCache

WINDOW = 24  # tokens; every session below is several windows long
ARCHITECTURES = {  # name -> (transformers' prefix, config overrides)
    "llama": ("Llama", {}),
    "mistral-sliding": ("Mistral", {"sliding_window": WINDOW}),
    "gemma2-mixed": ("Gemma2", {"sliding_window": WINDOW}),
    "gpt2": ("GPT2", {"num_key_value_heads": None}),  # learned absolute positions, no RoPE
    "gpt-neox-partial": ("GPTNeoX", {"num_key_value_heads": None, "rotary_pct": 0.25}),  # RoPE on 4 of 16 dims
    "phi3-partial": ("Phi3", {"partial_rotary_factor": 0.5}),
    "qwen2-sliding": ("Qwen2", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3": ("Qwen3", {}),
    "olmo2": ("Olmo2", {}),
    "mixtral": ("Mixtral", {"num_local_experts": 2, "num_experts_per_tok": 1}),
    "qwen2-moe": (
        "Qwen2Moe",
        {
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "gemma3-text": ("Gemma3Text", {"sliding_window": WINDOW}),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_model(request, tmp_path_factory) -> str:
    arch, config = ARCHITECTURES[request.param]
    return str(make_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **config))


@pytest.fixture(scope="module")
def arch_loaded(arch_model):
    """``arch_model`` loaded once: an Archive opened with it is still a new one (its state is on
    disk, as a new process finds it), without loading the model again for each."""
    return lm_ops.load(arch_model)


def turns(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out += [
            {"role": "user", "content": f"Question {i}: what comes after the harbour lights at night?"},
            {"role": "assistant", "content": f"Answer {i}: the long quiet sea, and the boats coming home."},
        ]
    return out


@pytest.mark.slow
def test_a_conversation_growing_across_processes_stores_true_logprobs(tmp_path, arch_loaded):
    """Each turn from a new Archive (as a new process would): the shared prefix resumes from the
    prefix cache on disk, which must hold every position of every layer."""
    path = tmp_path / "grow.duckdb"
    for n in (1, 2, 3):
        with kvdb.open(path, model=arch_loaded) as db:
            [result] = db.ingest(messages=turns(n), name=f"turn{n}")
            assert result.status == "ingested"
    with kvdb.open(path, model=arch_loaded) as db:
        model = db.loaded_model.model
        for n in (1, 2, 3):
            ids = db.tokens(f"turn{n}")
            assert len(ids) > 3 * WINDOW
            np.testing.assert_allclose(db.logprobs(f"turn{n}"), lm_ops.score(model, ids)[0], atol=1e-4)


def test_a_cache_entry_short_of_its_positions_is_not_resumed(tmp_path, arch_loaded):
    """An entry that holds fewer positions than its node (what a sliding layer's cache saved
    before caches were full-length) is passed over; verify names it, repair and gc delete it."""
    path = tmp_path / "stale.duckdb"
    with kvdb.open(path, model=arch_loaded) as db:
        first = db.ingest(messages=turns(1), name="one")[0]
        model = db.loaded_model.model
        ids = db.tokens("one")
    entries = PrefixCache(path.with_name(path.name + ".prefix"))
    short = lm_ops.prefill(model, ids[:WINDOW])  # claims the session, holds one window
    entries.save(first.session_id, short)
    with kvdb.open(path, model=arch_loaded) as db:
        assert any(f"holds {WINDOW} positions" in p for p in db.verify().problems)
        db.ingest(messages=turns(2), name="two")
        np.testing.assert_allclose(db.logprobs("two"), lm_ops.score(model, db.tokens("two"))[0], atol=1e-4)
        repaired = db.repair()
        assert repaired.pruned_prefix_cache_entries == 1 and repaired.ok
        entries.save(first.session_id, short)
        assert db.gc().prefix_cache_entries == 1
    assert first.session_id not in entries.entries()


def test_restore_past_the_window_continues_as_a_fresh_prefill(archive_of):
    db, ids = archive_of
    restored = db.restore("long", mode="exact")
    assert restored.cache.get_seq_length() == len(ids) and all(
        layer.keys.shape[-2] == len(ids) for layer in restored.cache.layers
    )
    probe = torch.tensor([[65, 66, 67]])
    model = db.loaded_model.model
    with torch.no_grad():
        resumed = model(probe, cache=restored.cache, use_cache=True).logits[0]
        fresh = model(torch.cat([torch.as_tensor(ids)[None], probe], dim=1)).logits[0, len(ids) :]
    torch.testing.assert_close(resumed, fresh, atol=1e-4, rtol=1e-4)
    assert isinstance(db.continue_session("long", max_new_tokens=3), str)  # no prompt: the cache is cropped by one


def test_tier_k_codes_every_position_of_every_layer(archive_of):
    db, ids = archive_of
    report = db.train_codebooks(preset="k2v1", tokens=2000, niter=2)
    assert report.tokens == len(ids) - 4  # every archived position but the sinks
    [kv] = db.ingest(text="A second long session, coded with tier K. " * 8, name="kv", keep="tokens,search,kv")
    for at in (WINDOW - 1, 2 * WINDOW + 3, kv.n_tokens):
        restored = db.restore("kv", at=at, mode="archive")
        assert restored.mode == "archive" and restored.cache.get_seq_length() == at
        assert all(layer.keys.shape[-2] == at for layer in restored.cache.layers)
    assert db.stats().kv_ratio_vs_fp16 > 1  # configs without num_key_value_heads count one per query head
    assert db.verify(deep=True).ok


@pytest.mark.slow
def test_tier_l_as_the_only_copy_reads_and_restores(tmp_path, arch_loaded):
    with kvdb.open(tmp_path / "lm.duckdb", model=arch_loaded) as db:
        [chat] = db.ingest(messages=turns(1), name="chat", keep="tokens,search,lm")
        text, ids = db.text("chat"), db.tokens("chat")
        db.compact("chat", "lm")
    with kvdb.open(tmp_path / "lm.duckdb", model=arch_loaded) as db:  # nothing decoded before
        assert db.text("chat") == text
        restored = db.restore("chat")
        assert restored.mode == "decode" and restored.cache.get_seq_length() == chat.n_tokens
        np.testing.assert_array_equal(restored.tokens, ids)


def test_a_model_without_a_per_layer_kv_cache_is_refused_before_anything_is_written(tmp_path):
    """Mamba keeps a recurrent state, not K/V per position: a typed error (exit 4), no session."""
    mamba = str(make_tiny_model(tmp_path / "mamba", arch="Mamba", state_size=4, expand=2))
    path = tmp_path / "m.duckdb"
    with kvdb.open(path, model=mamba) as db:
        with pytest.raises(kvdb.KvdbError, match="cannot archive") as refused:
            db.ingest(text="a session a recurrent model cannot have archived", name="m")
        assert refused.value.exit_code == 4
        assert db.sessions() == []


@pytest.fixture
def archive_of(tmp_path, arch_loaded):
    with kvdb.open(tmp_path / "long.duckdb", model=arch_loaded) as db:
        text = "The harbour lights come on one by one as the boats return. " * 6
        db.ingest(text=text, name="long")
        yield db, db.tokens("long")


def test_keys_are_taken_back_to_pre_rope_wherever_the_model_rotates_them(arch_loaded):
    """The rotary module is found wherever the architecture keeps it (GPT-NeoX: ``gpt_neox``), so
    tier K quantizes pre-RoPE keys as its codebooks say; GPT-2 has none to undo."""
    from kvdb.model import capture

    loaded = arch_loaded
    ids = np.arange(2 * WINDOW) % 200 + 3
    post, _ = capture.capture(loaded.model, ids)
    pre, _ = capture.capture(loaded.model, ids, pre_rope=True)
    rotates = loaded.model.config.model_type != "gpt2"
    assert (capture.rope_tables(loaded.model, 0, 1) is not None) == rotates
    assert np.allclose(pre[:, :, 1:], post[:, :, 1:]) != rotates  # position 0 is not rotated at all
    np.testing.assert_allclose(capture.apply_rope(loaded.model, pre, 0), post, atol=1e-5)


def test_the_recomputed_window_is_the_model_own_computation(arch_loaded):
    """From exact arrays, the archive restore (sinks and recent window recomputed in one masked
    pass) must give the cache a fresh prefill gives, sliding layers included."""
    from kvdb.model import capture

    loaded = arch_loaded
    ids = np.arange(6 * WINDOW) % 200 + 3
    keys, values = capture.capture(loaded.model, ids, pre_rope=True)
    restored = capture.restore_layers(loaded.model, ids, zip(keys, values), pre_rope=True)
    fresh = lm_ops.prefill(loaded.model, ids)
    for ours, theirs in zip(restored.layers, fresh.layers, strict=True):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-4, rtol=1e-4)


def test_the_same_weights_under_another_attention_config_are_another_model(tmp_path, tiny_model):
    """A Llama whose RoPE base differs computes other keys: other session ids, and a session of
    one is refused by the other (exit 4)."""
    other = tmp_path / "other-rope"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = 123456.0
    else:
        config["rope_theta"] = 123456.0
    (other / "config.json").write_text(json.dumps(config))
    path = tmp_path / "ids.duckdb"
    text = "The same weights, another attention config. " * 3
    with kvdb.open(path, model=tiny_model) as db:
        [first] = db.ingest(text=text, name="first")
    with kvdb.open(path, model=str(other)) as db:
        with pytest.raises(ModelMismatch) as refused:
            db.restore("first")
        assert refused.value.exit_code == 4
        [second] = db.ingest(text=text, name="second")
        assert second.status == "ingested" and second.session_id != first.session_id
