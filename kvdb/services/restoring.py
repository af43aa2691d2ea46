"""Putting an archived session back into the model: by an exact prefill over its tokens, from
tier K (no forward pass over the session), or by decoding tier L; and continuing it."""

from __future__ import annotations

import time

from kvdb.codecs import presets
from kvdb.errors import InvalidArgument
from kvdb.index import trie
from kvdb.model import capture, chat
from kvdb.model import loading as lm_ops
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import Fidelity, PresetFidelity, RestoredSession
from kvdb.services import restore_modes as restore_ops
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader, clip_range
from kvdb.services.tier_k import TierK
from kvdb.services.tier_l import TierL
from kvdb.storage import Storage
from kvdb.storage.base import NodeRow
from kvdb.tiers import DEFAULT_MAX_LOSS, DEFAULT_WINDOW, RESTORE_MODES, WINDOWS, check_max_loss

# what each mode does, as the end of a restore's reason
_DONE = {
    "exact": "prefilled exactly",
    "archive": "restored from tier K",
    "decode": "decoded from tier L (some tokens are kept only there)",
}


class Restorer:
    def __init__(
        self, storage: Storage, models: ModelProvider, reader: Reader, tier_k: TierK, tier_l: TierL, sinks: PrefixCache
    ):
        self._sinks = (
            sinks  # exact caches of paths' first positions, by content: every path that opens alike shares one
        )
        self._storage = storage
        self._models = models
        self._reader = reader
        self._tier_k = tier_k
        self._tier_l = tier_l

    def restore(
        self,
        ref: str,
        at: int | None = None,
        mode: str = "auto",
        window: str | None = None,
        max_loss: float = DEFAULT_MAX_LOSS,
    ) -> RestoredSession:
        if mode not in RESTORE_MODES:
            raise InvalidArgument(f"unknown restore mode {mode!r}; choose from {', '.join(RESTORE_MODES)}")
        if window is not None and window not in WINDOWS:
            raise InvalidArgument(f"unknown window {window!r}; choose from {', '.join(WINDOWS)}")
        max_loss = check_max_loss(max_loss)
        row = self._reader.resolve(ref)
        at = row.n_tokens if at is None else at
        clip_range(row, 0, at)
        loaded = self._models.for_session(row)
        path = self._storage.node_path(row.session_id)
        nodes = [n for n in path if n.start < at]
        measured = (
            self._tier_k.path_fidelity(nodes)
            if nodes and all("kv" in n.keep for n in nodes) and mode in ("auto", "archive")
            else None
        )
        mode, reason = _mode(mode, nodes, measured, max_loss)
        # the preset's, unless told
        window = window or (presets.restore_window(measured.spec) if measured is not None else DEFAULT_WINDOW)
        restored = self._restore(loaded, row, path, nodes, at, mode, window)
        restored.reason = reason
        restored.fidelity = measured if restored.mode == "archive" else None
        return restored

    def _restore(
        self, loaded, row, path: list[NodeRow], nodes: list[NodeRow], at: int, mode: str, window: str
    ) -> RestoredSession:
        if mode == "decode" and nodes:
            return self._tier_l.restore(row, nodes, at)
        tokens = self._reader.path_tokens(row, 0, at, path)
        if mode == "exact" or not nodes:  # nothing before position 0 to read from any tier
            self._storage.before_compute()  # the forward passes need nothing more from the file
            return restore_ops.restore_exact(loaded, row.session_id, tokens)
        start = time.perf_counter()
        layers = self._tier_k.layers(row, nodes, at)
        self._storage.before_compute(short=window == "stored")  # a stored window's restore is short work, like a search
        sinks = self._exact_sinks(loaded, tokens) if window == "stored" else None
        return restore_ops.restore_archive(loaded, row.session_id, tokens, layers, start, window, sinks)

    def _exact_sinks(self, loaded, tokens):
        """The exact cache of the path's first positions: from this machine's cache of them, or
        computed once (a forward pass of 4 tokens) for each new opening and kept."""
        head = tokens[: capture.SINKS]
        key = trie.path_id(loaded.identity.model_id, head)
        found = self._sinks.arrays(key, len(head))
        if found is None:
            cache = lm_ops.prefill(loaded.model, head)
            self._sinks.save(key, cache)
            found = capture.cache_arrays(cache)
        return found

    def fidelity(self, ref: str, at: int | None = None, probe: int = 32, window: str | None = None) -> Fidelity:
        """Restore both ways ``probe`` tokens before ``at`` and teacher-force the session's next
        tokens through each."""
        row = self._reader.resolve(ref)
        at = row.n_tokens if at is None else at
        clip_range(row, 0, at)
        cut = max(capture.SINKS + 1, at - probe)
        if at - cut < 2:
            raise InvalidArgument(f"a fidelity probe needs at least {capture.SINKS + 3} tokens up to --at")
        archived = self.restore(row.session_id, at=cut, mode="archive", window=window)
        exact = self.restore(row.session_id, at=cut, mode="exact")
        return Fidelity(
            **restore_ops.fidelity(
                self._models.get(), archived.cache, exact.cache, self._reader.path_tokens(row, cut, at)
            )
        )

    def generate(self, restored: RestoredSession, prompt: str | None = None, max_new_tokens: int = 64) -> str:
        """Continue a restored session greedily, from the same state however often it is called."""
        loaded = self._models.get()
        # a chat: ingested as one, or a text whose turns the template framed (a server's continuation)
        as_turn = self._reader.resolve(restored.session_id).metadata.get("kind") == "chat" or any(
            role is not None for role, _, _ in chat.turns(loaded.tokenizer, restored.tokens)
        )
        prompt_ids = restore_ops.continuation_ids(loaded, prompt, as_turn, restored.tokens)
        return restore_ops.continue_restored(loaded, restored, prompt_ids, max_new_tokens)


def _mode(asked: str, nodes: list[NodeRow], measured: PresetFidelity | None, max_loss: float) -> tuple[str, str]:
    """The mode a restore takes, and why, in a sentence for the user (decision 0039): ``measured``
    is the fidelity of the path's tier K, None where some node has none."""
    if not nodes:
        return "exact", "nothing before position 0 to restore"
    if asked == "archive" and measured is not None:
        return asked, f"{_DONE[asked]}, as asked (mode archive); {restore_ops.measured_words(measured)}"
    if asked != "auto":
        return asked, f"{_DONE[asked]}, as asked (mode {asked})"
    # where tier L is the only copy of some tokens, decoding it rebuilds the cache in the same pass
    fallback = "exact" if all("tokens" in n.keep for n in nodes) else "decode"
    if measured is None:
        return fallback, f"not every token restored has tier K: {_DONE[fallback]}"
    taken, why = restore_ops.judged(measured, max_loss)
    return ("archive", f"{why}: {_DONE['archive']}") if taken else (fallback, f"{why}: {_DONE[fallback]}")
