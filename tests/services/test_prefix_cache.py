"""The prefix cache's chains, precision and cap, on caches of the tiny model (no archive)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kvdb
from kvdb.model import capture
from kvdb.model import loading as lm_ops
from kvdb.model.prefix_cache import PrefixCache, Trimmed

IDS = np.arange(3, 63, dtype=np.int64)  # one conversation; its turns end at 20, 40 and 60
TURNS = (20, 40, 60)


def key(end: int) -> str:
    return f"path{end:028d}"


def shorter(end: int) -> list[tuple[str, int]]:
    return [(key(e), e) for e in reversed(TURNS) if e < end]


@pytest.fixture
def model(tiny_loaded):
    return tiny_loaded.model


def keep_turns(cache_folder: PrefixCache, model) -> None:
    for end in TURNS:
        cache_folder.save(key(end), lm_ops.prefill(model, IDS[:end]), shorter(end))


def test_a_conversation_stores_each_position_once_in_half_precision(tmp_path, model):
    folder = PrefixCache(tmp_path / "p", budget_mb=64)
    keep_turns(folder, model)
    whole = lm_ops.prefill(model, IDS)
    fp32 = sum(a.nbytes for a in capture.cache_arrays(whole))
    assert fp32 / 2 <= folder.size() < fp32 / 2 + 3 * 4096  # 60 positions in float16, plus three headers
    assert folder.entries() == {key(e): e for e in TURNS}
    keys, values = folder.arrays(key(60), 60)
    for ours, exact in zip((keys, values), capture.cache_arrays(whole), strict=True):
        np.testing.assert_array_equal(ours, exact.astype(np.float16).astype(np.float32))
    held, cache = folder.load(model, [(key(60), 60)])
    step = torch.as_tensor(IDS[-1:]).reshape(1, 1)
    with torch.no_grad():
        ours = torch.log_softmax(model(step, cache=cache).logits[0, -1].float(), -1)
        exact = torch.log_softmax(model(step, cache=lm_ops.prefill(model, IDS)).logits[0, -1].float(), -1)
    assert held == 60 and float((ours - exact).abs().max()) < 1e-3


def test_values_past_float16_are_kept_in_float32(tmp_path, model):
    folder = PrefixCache(tmp_path / "p", budget_mb=64)
    keys, values = capture.cache_arrays(lm_ops.prefill(model, IDS[:20]))
    keys[0, 0, 0, 0] = 1e6  # past float16's largest, 65504
    folder.save(key(20), capture.build_cache(model, keys, values))
    np.testing.assert_array_equal(folder.arrays(key(20), 20)[0], keys)


def test_a_damaged_parent_takes_its_chain_with_it(tmp_path, model):
    folder = PrefixCache(tmp_path / "p", budget_mb=64)
    keep_turns(folder, model)
    data = bytearray(folder.path(key(20)).read_bytes())
    data[-3] ^= 0x10
    folder.path(key(20)).write_bytes(bytes(data))
    orphans = sum(folder.path(key(e)).stat().st_size for e in (40, 60))
    assert folder.load(model, [(key(60), 60), (key(40), 40)]) is None  # and the damaged entry is deleted
    assert folder.trim() == Trimmed(2, orphans)
    assert folder.entries() == {}


def test_an_entry_chained_to_a_pruned_one_goes_with_it(tmp_path, model):
    folder = PrefixCache(tmp_path / "p", budget_mb=64)
    keep_turns(folder, model)
    assert folder.prune({key(40): 40, key(60): 60}) == 3
    assert folder.entries() == {}


def test_the_cap_evicts_least_recently_used_first_and_never_a_kept_entrys_parent(tmp_path, model):
    folder = PrefixCache(tmp_path / "p", budget_mb=64)
    keep_turns(folder, model)
    other = IDS[::-1].copy()
    folder.save("other", lm_ops.prefill(model, other[:40]))
    for at, name in enumerate(["other", key(20), key(40), key(60)]):
        os.utime(folder.path(name), (1000 + at, 1000 + at))  # the root oldest: its chain's use makes it recent
    sizes = {name: folder.path(name).stat().st_size for name in folder.entries()}
    chain = sizes[key(20)] + sizes[key(40)] + sizes[key(60)]
    assert PrefixCache(folder.folder, budget_mb=(chain + 1) / 2**20).trim() == Trimmed(1, sizes["other"])
    assert PrefixCache(folder.folder, budget_mb=(chain - 1) / 2**20).trim() == Trimmed(
        1, sizes[key(60)]
    )  # the leaf, not the root
    assert folder.entries() == {key(20): 20, key(40): 40}
    assert folder.arrays(key(40), 40) is not None


def test_gc_brings_the_prefix_cache_within_a_lowered_cap(tmp_path, tiny_loaded):
    path = tmp_path / "a.duckdb"
    turns = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi! How can I help?"}]
    for n in range(1, 4):
        with kvdb.open(path, model=tiny_loaded) as db:
            db.ingest(messages=turns * n, name=f"t{n}")
            db.upkeep()  # the model's pass, which keeps each session's cache
    entries = sorted((tmp_path / "a.duckdb.prefix").iterdir())
    assert len(entries) == 3
    with kvdb.open(path, model=tiny_loaded, prefix_cache_mb=entries[0].stat().st_size / 2**21) as db:
        assert db.gc().prefix_cache_entries == 3
        assert db.stats().bytes["prefix_cache"] == 0
