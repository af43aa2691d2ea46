"""The second stage of the write path, and the only place it runs the model: a plan's
log-probabilities, cache, tier-L payloads and tier-K codes, computed with the file let go.

What was computed before is not computed again:
- ``Computed``, a caller's own pass over the tokens (``kvdb serve`` hands over what generation
  produced, so a reply goes through the model once);
- the last session's cache in this process (turns of one conversation ingested in a row);
- an exact cache of the deepest archived path node in the prefix cache (another process's).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdb.index import trie
from kvdb.model import tokenizer as tok
from kvdb.model.prefix_cache import PrefixCache
from kvdb.services.tier_l import RECENT_CACHE_TOKENS, TierL
from kvdb.services.write_plan import Planned, SessionPlan
from kvdb.storage import Storage
from kvdb.storage.base import AddTiers, NewNode, NodeRow, NodeTiers, SessionRow, SessionWrite, utc_now

if TYPE_CHECKING:  # torch, which tier K needs, is imported when the model is
    from kvdb.services.tier_k import TierK

# Work shorter than this many new tokens (a fraction of a second of the model) keeps the file while
# the hold is fresh (Storage.before_compute): readers wait at most about a second, and a stream of
# short sessions does not pay a reconnect each (decision 0012).
SHORT_WORK_TOKENS = 128


@dataclass(frozen=True)
class Computed:
    """A pass over ``ids`` the caller made already: ``logprobs`` holds ln p(ids[i] | ids[:i])
    for i in [``start``, len(ids)), and ``cache`` the exact cache of a prefix of ``ids`` at least
    len(ids) - 1 long. Taken as read-only (it is copied before it is extended)."""

    ids: np.ndarray
    logprobs: np.ndarray
    start: int
    cache: Any  # a transformers DynamicCache

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.ids) - self.start or self.cache.get_seq_length() < len(self.ids) - 1:
            raise ValueError("Computed: logprobs must cover ids[start:] and the cache all of ids but the last at least")


@dataclass(frozen=True)
class SessionWork:
    """A new session's write and the cache of all its tokens (for the tiers its path lacks, and
    the prefix cache)."""

    write: SessionWrite
    cache: Any  # a transformers DynamicCache; None where the model did not run


class WriteCompute:
    def __init__(self, storage: Storage, tier_l: TierL, tier_k: Callable[[], TierK], prefix_cache: PrefixCache):
        self._storage = storage
        self._tier_l = tier_l
        self._tier_k = tier_k  # built on first use: most ingests keep no tier K
        self._prefix_cache = prefix_cache
        self._recent: tuple[np.ndarray, object] | None = (
            None  # (ids, cache) of the last session scored, for the next one's shared prefix
        )

    def session(
        self,
        loaded,
        planned: Planned,
        plan: SessionPlan,
        books: str | None,
        given: Computed | None = None,
        score: bool = False,
    ) -> SessionWork:
        """The write of a session the trie does not hold: its new node (and the split of the node
        it leaves), computed over what is new only. ``books``: tier K's codebook id. The model's
        pass is made where the plan needs it, a caller's own is given, or ``score`` asks. The
        semantic tier is never in ``plan.keep`` here: ingest queues it, and upkeep embeds it."""
        match, ids, keep = plan.match, plan.ids, plan.keep
        assert match is not None  # a plan for a new session
        model_id = loaded.identity.model_id
        split_tokens, split_kv = None, None
        if plan.splits and match.node is not None and "lm" in match.node.keep:
            split_tokens = self._tier_l.node_tokens(match.node, ids[: match.node.start])
        if plan.splits and match.node is not None and "kv" in match.node.keep:
            split_kv = self._tier_k().cut(match.node, match.offset)
        resumable = trie.ends_deepest_first(plan.path)  # deepest first, with the positions each holds
        first = plan.scored_from
        # else the model's pass is queued (pending_work)
        scoring = (plan.runs_model or given is not None or score) and first < len(ids)
        short = (len(ids) - first < SHORT_WORK_TOKENS or not scoring) and "lm" not in keep
        self._storage.before_compute(short=short)  # reads done: the model's work needs no file
        split, parent_id, lm_context = None, None, None
        if plan.splits:
            parent_id = trie.path_id(model_id, ids[: match.matched])
            split, lm_context = self._tier_l.split(loaded, match, ids, parent_id, split_tokens)
            if split_kv is not None:
                split = dataclasses.replace(split, kv_head=split_kv[0], kv_tail=split_kv[1])
        elif match.node is not None:
            parent_id = match.node.node_id
        logprobs, cache = self._score(loaded, ids, first, resumable, given) if scoring else (None, None)
        tokens_back = {
            n.node_id: (ids[n.start : n.end], logprobs[n.start - first : n.end - first])
            for n in plan.back
            if logprobs is not None
        }
        node = None
        if match.matched < len(ids):
            payload = self._tier_l.encode(loaded, ids, match.matched, lm_context) if "lm" in keep else None
            kv = self._tier_k().codes(loaded, cache, match.matched, codebook_id=books) if "kv" in keep else None
            scored = None if logprobs is None else logprobs[match.matched - first :]
            node = NewNode(plan.session_id, parent_id, match.matched, ids[match.matched :], scored, keep, payload, kv)
        item = planned.item
        metadata = dict(item.metadata, kind="text" if item.text is not None else "chat")
        if item.text is not None and tok.decode(loaded.tokenizer, ids) != item.text:
            metadata["text"] = item.text  # this tokenizer does not round-trip it: kept verbatim so `show` stays exact
        row = SessionRow(plan.session_id, item.name, item.source, model_id, utc_now(), len(ids), metadata)
        alphabet = max(loaded.vocab_size, len(loaded.tokenizer))
        # a split's head stands for the node it cuts
        above = [n.node_id for n in plan.path[:-1]] + ([parent_id] if parent_id is not None else [])
        path = (*above, node.node_id) if node is not None else tuple(above)
        return SessionWork(SessionWrite(row, alphabet, split, node, tokens_back=tokens_back, path=path), cache)

    def tiers(self, loaded, plan: SessionPlan, books: str | None, cache=None) -> tuple[AddTiers, dict, object]:
        """(the AddTiers of the tiers the plan's path lacks, the nodes joining the search index
        with their tokens and the tokens before them, the cache of the whole session if tier K
        needed one). ``cache``: the session's own, when its write was just computed."""
        ids = plan.ids
        missing = {n.node_id: tiers for n, tiers in plan.lacking}
        nodes = [n for n, _ in plan.lacking]
        back, lm, kv = ([n for n in nodes if tier in missing[n.node_id]] for tier in ("tokens", "lm", "kv"))
        # log-probabilities of tokens given back; a cache for tier K
        scoring = bool(back) or (bool(kv) and cache is None)
        self._storage.before_compute(short=not lm and not (scoring and len(ids) >= SHORT_WORK_TOKENS))
        given: dict[str, dict] = {n.node_id: {} for n in nodes}
        if scoring:
            first = min((n.start for n in back), default=len(ids))
            logprobs, cache = self._score(loaded, ids, first, trie.ends_deepest_first(plan.path))
            for n in back:
                given[n.node_id]["tokens"] = (ids[n.start : n.end], logprobs[n.start - first : n.end - first])
        for node_id, payload in self._tier_l.encode_nodes(loaded, ids, lm).items():
            given[node_id]["lm"] = payload
        for n in kv:
            given[n.node_id]["kv"] = self._tier_k().codes(loaded, cache, n.start, n.end, codebook_id=books)
        joining = {n.node_id: (ids[n.start : n.end], ids[: n.start]) for n in nodes if "search" in missing[n.node_id]}
        return AddTiers({node_id: NodeTiers(**tiers) for node_id, tiers in given.items() if tiers}), joining, cache

    def owed(
        self, loaded, ids: np.ndarray, path: list[NodeRow], unscored: list[NodeRow]
    ) -> tuple[dict[str, np.ndarray], Any]:
        """The model's pass that an ingest without it queued (``kvdb upkeep``): log-probabilities
        of the ``unscored`` nodes of a session's ``path``, and the cache of all its ``ids``."""
        at = min([len(ids) - 1] + [n.start for n in unscored])  # one position at least: the pass leaves the whole cache
        self._storage.before_compute()
        logprobs, cache = self._score(loaded, ids, at, trie.ends_deepest_first(path))
        return {n.node_id: logprobs[n.start - at : n.end - at] for n in unscored}, cache

    def _score(
        self, loaded, ids: np.ndarray, start: int, resumable: list[tuple[str, int]], given: Computed | None = None
    ):
        """Log-probabilities of ids[start:] and the cache of all of ``ids``: taken from ``given``
        as far as it agrees with ``ids``, else resuming the shared prefix's cache from the last
        session scored in this process, else from the prefix cache on disk (the deepest of the
        ``resumable`` path nodes it holds), else prefilling it; only the rest is computed."""
        from kvdb.model import loading as lm_ops

        reused = _reuse(given, ids, start)
        if reused is not None:
            known, at, cache = reused
            logprobs, cache = lm_ops.score(loaded.model, ids, start=at, cache=cache)
            logprobs = np.concatenate([known, logprobs])
        else:
            logprobs, cache = lm_ops.score(
                loaded.model, ids, start=start, cache=self._resumed(loaded, ids, start - 1, resumable)
            )
        self._recent = (ids, cache) if len(ids) <= RECENT_CACHE_TOKENS else None
        return logprobs, cache

    def _resumed(self, loaded, ids: np.ndarray, fed: int, resumable: list[tuple[str, int]]):
        """A cache holding ids[:fed], from the last session scored or the prefix cache (None when
        neither shares any of it: ``score`` then prefills)."""
        from kvdb.model import loading as lm_ops

        if fed <= 0:
            return None
        cache: Any = None
        held = 0
        if self._recent is not None and np.array_equal(self._recent[0][:fed], ids[:fed]):
            cache, held = copy.deepcopy(self._recent[1]), len(self._recent[0])
        else:
            held, cache = self._prefix_cache.load(loaded.model, resumable) or (0, None)
        if cache is not None and held > fed:
            cache.crop(fed - held)
        if cache is not None and held < fed:  # held only an earlier turn: compute the rest onto it
            cache = lm_ops.prefill(loaded.model, ids[:fed], cache=cache)
        return cache


def _reuse(given: Computed | None, ids: np.ndarray, start: int) -> tuple[np.ndarray, int, object] | None:
    """(the log-probabilities of ids[start:at] that ``given`` holds, at, a copy of its cache
    cropped to ids[:at - 1]) where ``given`` covers ids[start:at] for some at > start; else None."""
    if given is None or given.start > start:
        return None
    at = trie.common_prefix(given.ids, ids)
    if at <= start:
        return None
    cache: Any = copy.deepcopy(given.cache)  # the caller's stays as it was
    held = cache.get_seq_length()
    if held > at - 1:
        cache.crop(at - 1 - held)
    return given.logprobs[start - given.start : at - given.start], at, cache
