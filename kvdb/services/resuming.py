"""Resuming a token stream from what the archive holds of it, without a forward pass over it:
the exact cache the prefix cache keeps for its longest archived prefix, or tier K's; and
keeping exact caches there for later. A server resumes conversations this way after a restart,
or after another process archived them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvdb.errors import InvalidArgument
from kvdb.index import trie
from kvdb.model import capture
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import RestoredSession
from kvdb.services import restore_modes as restore_ops
from kvdb.services.models import ModelProvider
from kvdb.services.tier_l import TierL
from kvdb.storage import Storage
from kvdb.tiers import DEFAULT_MAX_LOSS, RestoreMode, check_max_loss

if TYPE_CHECKING:
    from kvdb.services.tier_k import TierK

RESUME_MODES = ("exact", "auto", "archive")


class Resumer:
    def __init__(
        self,
        storage: Storage,
        models: ModelProvider,
        tier_l: TierL,
        tier_k: Callable[[], TierK],
        prefix_cache: PrefixCache,
    ):
        self._storage = storage
        self._models = models
        self._tier_l = tier_l
        self._tier_k = tier_k  # built on first use: only `--restore archive` reads tier K
        self._prefix_cache = prefix_cache

    def resume(
        self, ids: np.ndarray, better_than: int = 0, mode: str = "exact", max_loss: float = DEFAULT_MAX_LOSS
    ) -> RestoredSession | None:
        """The cache of the longest archived prefix of ``ids`` longer than ``better_than`` tokens:
        from the prefix cache (the deepest node of the matched path it holds, cropped to the
        match: the prefix of an archived exchange is resumed from the exchange's cache), or, with
        ``mode="archive"``, from tier K where that restores more than its recomputed window
        adds (``"auto"``: only where its preset is measured within ``max_loss``, as a restore's
        auto); None when neither has more. ``session_id`` names the archived path restored."""
        if mode not in RESUME_MODES:
            raise InvalidArgument(f"unknown resume mode {mode!r}; choose from {', '.join(RESUME_MODES)}")
        max_loss = check_max_loss(max_loss)
        loaded = self._models.get()
        model_id = loaded.identity.model_id
        ids = np.asarray(ids, dtype=np.int64)
        started = time.perf_counter()
        match = trie.longest_prefix(
            self._storage,
            model_id,
            ids,
            lambda node: self._tier_l.node_tokens(node, ids[: node.start], like=ids[node.start :]),
        )
        if match.node is None or match.matched <= better_than:
            return None
        path = list(match.path)
        at = match.matched
        found = self._prefix_cache.load(loaded.model, trie.ends_deepest_first(path, better_than))
        if found is not None and found[0] > at:
            found[1].crop(at - found[0])
            found = (at, found[1])
        held = found[0] if found is not None else better_than
        # tier K is read through a session: the one ending in the match's node
        leaf = self._storage.get_session(match.node.node_id)
        nodes = [n for n in path if n.start < at]
        if (
            mode != "exact"
            and leaf is not None
            and at - capture.SINKS - capture.RECENT > held
            and all("kv" in n.keep for n in nodes)
        ):
            measured = self._tier_k().path_fidelity(nodes)
            taken, why = (
                restore_ops.judged(measured, max_loss)
                if mode == "auto"
                else (True, restore_ops.measured_words(measured))
            )
            if taken:
                layers = self._tier_k().layers(leaf, nodes, at)
                # the server counts the window it recomputes as computed (not cached) tokens
                restored = restore_ops.restore_archive(
                    loaded, trie.path_id(model_id, ids[:at]), ids[:at], layers, started, window="recompute"
                )
                restored.reason, restored.fidelity = why, measured
                return restored
        if found is None:
            return None
        return RestoredSession(
            trie.path_id(model_id, ids[:held]),
            loaded.model,
            loaded.tokenizer,
            found[1],
            held,
            RestoreMode.EXACT,
            time.perf_counter() - started,
            ids[:held],
        )

    def keep(self, ids: np.ndarray, cache) -> None:
        """Keep ``cache``, the exact cache of ``ids`` (an archived path's tokens), in the prefix
        cache, so that a later process resumes the path without computing it. Only what it adds
        to the deepest node of its path with an entry is stored: a conversation's turns share."""
        if cache.get_seq_length() != len(ids):
            raise ValueError(f"the cache holds {cache.get_seq_length()} positions, the tokens are {len(ids)}")
        key = trie.path_id(self._models.get().identity.model_id, np.asarray(ids, dtype=np.int64))
        self._prefix_cache.save(key, cache, trie.ends_deepest_first(self._storage.node_path(key)))
