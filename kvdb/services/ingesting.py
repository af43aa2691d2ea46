"""Archiving sessions: parse, find the longest archived prefix in the trie, run the model only
over what is new, and commit one plan per session.

The file is let go while the model works, so readers and other writers get in; if one of
them changed the trie where the session attaches, the plan is made again against it. The
last session's cache is kept for the next one (turns of one conversation ingested in a row),
and a conversation seen growing leaves its exact cache in the prefix cache for the next
process.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvdb import transcripts
from kvdb.errors import InvalidArgument, StaleWrite, TranscriptError
from kvdb.index import trie
from kvdb.index.walk import Indexes, index_key
from kvdb.model import chat
from kvdb.model import tokenizer as tok
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import IngestResult
from kvdb.services.models import ModelProvider
from kvdb.services.tier_l import RECENT_CACHE_TOKENS, TierL
from kvdb.storage import Storage
from kvdb.storage.base import (
    AddTiers,
    NewNode,
    NodeRow,
    NodeTiers,
    SessionRow,
    SessionWrite,
    utc_now,
)
from kvdb.tiers import TIERS, parse_keep

if TYPE_CHECKING:  # torch, which tier K needs, is imported when the model is: a malformed file is refused without it
    from transformers import DynamicCache

    from kvdb.services.tier_k import TierK

# progress(done, planned): tokens just archived, and tokens newly known to be coming (a file's
# sessions are counted when its check pass ends), so a progress bar can show a total.
Progress = Callable[[int, int], None]
# A session can hold at most the model's context; no session file can fit it with more than this
# many bytes per context token (SmolLM2's longest token is 81 bytes, and JSON escapes take at
# most 6 bytes a byte), so larger sessions are refused before they are read into memory.
FILE_BYTES_PER_CONTEXT_TOKEN = 1024
LONGEST_CONTEXT_TOKENS = 1 << 17  # 128 MiB a session: a memory guard for the parse before the model loads
# Ingest lets the file go during the model's work, unless the work is short (fewer new tokens
# than this, ~0.3 s on 2 cores) and the file has been held for less than HOLD_SECONDS: readers
# then wait at most about a second, and a stream of short sessions does not pay a reconnect each.
SHORT_WORK_TOKENS = 128
COMMIT_ATTEMPTS = 50  # another writer's commit won each time: past this, say so instead of trying forever
CLAIM_LEASE_SECONDS = 600.0  # a claim outlives a dead worker by this long at most; renewed after each session


class Ingester:
    def __init__(self, storage: Storage, models: ModelProvider, tier_l: TierL, tier_k: Callable[[], TierK], indexes: Indexes, prefix_cache: PrefixCache):
        self._storage = storage
        self._models = models
        self._tier_l = tier_l
        self._tier_k = tier_k  # built on first use: most ingests keep no tier K
        self._indexes = indexes
        self._prefix_cache = prefix_cache
        self._recent: tuple[np.ndarray, DynamicCache] | None = None  # (ids, cache) of the last session scored, for the next one's shared prefix
        self._pending_prefix: tuple[str, np.ndarray, DynamicCache] | None = None  # (session id, ids, cache) of the last growing conversation, saved on close
        self._owner = f"{socket.gethostname()}:{os.getpid()}"  # who holds this process's claims on input files

    def close(self) -> None:
        if self._pending_prefix is not None:
            self._prefix_cache.save(self._pending_prefix[0], self._pending_prefix[2])
            self._pending_prefix = None

    def ingest(self, source, *, text: str | None, messages: Sequence[dict] | None, name: str | None, keep, progress: Progress | None) -> list[IngestResult]:
        if sum(x is not None for x in (source, text, messages)) != 1:
            raise InvalidArgument("give exactly one of: paths, text=, messages=")
        self._storage.check_writable()
        optional = parse_keep(keep)
        if text is not None:
            return self._ingest_source(lambda: [transcripts.transcript_from_text(text, name or "text")], optional, progress)
        if messages is not None:
            return self._ingest_source(lambda: [transcripts.transcript_from_messages(messages, name or "messages")], optional, progress)
        paths = [source] if isinstance(source, (str, Path)) else list(source)
        results: list[IngestResult] = []
        found: list[Path] = []
        for given in paths:  # a path that is missing or of no supported kind fails alone; the others still ingest
            try:
                found += transcripts.find_transcript_files([given])
            except TranscriptError as exc:
                results.append(IngestResult(None, Path(given).stem, str(given), 0, "failed", str(exc)))
        for path in dict.fromkeys(found):
            results.extend(self._ingest_file(path, optional, progress))
        return results

    def _ingest_file(self, path: Path, optional: frozenset[str], progress: Progress | None) -> list[IngestResult]:
        """One input file; where workers on other machines may share the folder (a lake), it is
        claimed while it is archived (renewed after each session), so that they pass it by. A
        file archive claims nothing, and so reads no file a second time to name its claim."""

        def archive(progress: Progress | None) -> list[IngestResult]:
            try:
                return self._ingest_source(lambda: transcripts.iter_transcripts(path, self._session_bytes()), optional, progress)
            except TranscriptError as exc:
                return [IngestResult(None, path.stem, str(path), 0, "failed", str(exc))]

        if not self._storage.claims_inputs:
            return archive(progress)
        key = _claim_key(path, optional)
        holder = self._storage.claim(key, self._owner, CLAIM_LEASE_SECONDS)
        if holder is not None and _gone_from_here(holder):  # a worker of this machine that died holding it
            holder = self._storage.claim(key, self._owner, CLAIM_LEASE_SECONDS, steal_from=holder)
        if holder is not None:
            return [IngestResult(None, path.stem, str(path), 0, "claimed", claimed_by=holder)]

        def renewing(done: int, planned: int) -> None:
            if not planned:
                self._storage.claim(key, self._owner, CLAIM_LEASE_SECONDS)
            if progress:
                progress(done, planned)

        try:
            return archive(renewing)
        finally:
            self._storage.release_claim(key, self._owner)

    def check_keep(self, keep) -> None:
        """Make ready at once what tier K needs (the model, and the shipped codebooks' first build
        on this machine), for a caller that ingests later and unattended, such as a server, and
        must fail at start instead."""
        if "kv" in parse_keep(keep):
            self._tier_k().codebooks(self._models.get().identity.model_id)

    def _ingest_source(self, sessions: Callable[[], Iterable], optional: frozenset[str], progress: Progress | None) -> list[IngestResult]:
        """Archive the sessions of one source in two passes over it, so that memory holds one
        session at a time however large the file: the first checks every session (a failure
        anywhere writes nothing), the second archives them one by one. A file is parsed once
        more before the model loads, so that a malformed one is refused in milliseconds."""
        if self._models.loaded is None:
            for _ in sessions():
                pass
        loaded = self._models.get()
        planned = sum(len(self._render(loaded, item)) for item in sessions())
        if progress:
            progress(0, planned)
        results = []
        try:
            for item in sessions():
                ids = self._render(loaded, item)
                result = self._ingest_one(loaded, item, ids, optional)
                results.append(dataclasses.replace(result, dropped=item.dropped) if item.dropped else result)
                if progress:
                    progress(len(ids), 0)
        finally:
            self._storage.release()  # done writing: other processes need not wait for this object's next call
        return results

    def _ingest_one(self, loaded, item, ids: np.ndarray, optional: frozenset[str]) -> IngestResult:
        """Store only what the trie does not hold yet, computing the model only over it."""
        began = time.perf_counter()
        model_id = loaded.identity.model_id
        session_id = trie.path_id(model_id, ids)

        def tokens_of(node: NodeRow) -> np.ndarray:  # this session's prefix is the context a tier-L node decodes in
            return self._tier_l.node_tokens(node, ids[: node.start], like=ids[node.start :])

        planned = None  # (the match it was made for, the write, the cache): model work kept across retries
        for _ in range(COMMIT_ATTEMPTS):
            self._index_ready(loaded, optional)
            seen = self._storage.version()  # the commit is refused if anything lands after this
            if self._storage.has_session(session_id):  # archived already: it may be asked for tiers its path lacks
                added = self._add_tiers(loaded, session_id, ids, optional)
                return IngestResult(
                    session_id, item.name, item.source, len(ids), "updated" if added else "unchanged", seconds=time.perf_counter() - began, added=added
                )
            match = trie.longest_prefix(self._storage, model_id, ids, tokens_of, min_split=trie.MIN_SPLIT)
            if planned is None or planned[0] != _match_key(match):
                planned = (_match_key(match), *self._session_write(loaded, item, session_id, ids, match, optional))
            _, write, cache = planned
            try:
                self._commit(loaded, write, match, ids, seen)
                break
            except StaleWrite:  # another writer committed meanwhile: match again; the write stands if the match is the same
                continue
        else:
            raise StaleWrite(f"{COMMIT_ATTEMPTS} commits of session {session_id[:12]} in a row found another writer's first; run the ingest again")
        grows = match.node is not None and match.offset == match.node.n_tokens and self._storage.has_session(match.node.node_id)
        self._add_tiers(loaded, session_id, ids, optional, cache)  # the shared prefix stored before with fewer tiers
        if grows and cache is not None:  # a conversation that grows: its next turn may come in another process
            self._keep_prefix(session_id, ids, cache)
        return IngestResult(session_id, item.name, item.source, len(ids), "ingested", None, len(ids) - match.matched, time.perf_counter() - began)

    def _index_ready(self, loaded, optional: frozenset[str]) -> None:
        """Bring the search index up to date (a rebuild commits) before the snapshot a commit
        that adds to it rests on is read: else the rebuild itself would make that commit stale."""
        if "search" in optional:
            tok_hash = loaded.identity.tokenizer_hash
            self._indexes.get(index_key(tok_hash), tok_hash, max(loaded.model.config.vocab_size, len(loaded.tokenizer)))

    def _commit(self, loaded, write: SessionWrite, match: trie.PrefixMatch, ids: np.ndarray, based_on) -> None:
        if write.node is None or "search" not in write.node.keep:
            self._storage.apply(write, based_on)
        else:
            tok_hash = loaded.identity.tokenizer_hash
            self._indexes.commit(
                index_key(tok_hash), tok_hash, write, {write.node.node_id: (write.node.tokens, ids[: match.matched])}, write.alphabet, based_on
            )

    def _session_write(self, loaded, item, session_id: str, ids: np.ndarray, match: trie.PrefixMatch, optional: frozenset[str]):
        """(what the session adds to the storage, the model's cache over it): reads first, then
        the model's work with the file let go."""
        model_id = loaded.identity.model_id
        split_tokens = None
        if match.node is not None and match.offset < match.node.n_tokens and "lm" in match.node.keep:
            split_tokens = self._tier_l.node_tokens(match.node, ids[: match.node.start])
        books = self._tier_k().codebooks(model_id)[0] if "kv" in optional else None  # the shipped ones when the archive has none
        on_path = self._storage.node_path(match.node.node_id) if match.node is not None else []
        resumable = [(n.node_id, n.end) for n in reversed(on_path)]  # deepest first, with the positions each holds
        # a node held in tier L only that this session now shares gets its tokens back, from the session's own
        back = [n for n in on_path if "tokens" not in n.keep and n.end <= match.matched]
        first = min((n.start for n in back), default=match.matched)  # scored from here: those nodes need log-probabilities
        self._storage.before_compute(short=len(ids) - first < SHORT_WORK_TOKENS and "lm" not in optional)
        split, parent_id, node, lm_context = None, None, None, None
        if match.node is not None and match.offset < match.node.n_tokens:
            parent_id = trie.path_id(model_id, ids[: match.matched])
            split, lm_context = self._tier_l.split(loaded, match, ids, parent_id, split_tokens)
        elif match.node is not None:
            parent_id = match.node.node_id
        cache, tokens_back = None, {}
        if first < len(ids):
            logprobs, cache = self._score_suffix(loaded, ids, first, resumable)
            tokens_back = {n.node_id: (ids[n.start : n.end], logprobs[n.start - first : n.end - first]) for n in back}
        if match.matched < len(ids):
            payload = self._tier_l.encode(loaded, ids, match.matched, lm_context) if "lm" in optional else None
            kv = self._tier_k().codes(loaded, cache, match.matched, codebook_id=books) if "kv" in optional else None
            node = NewNode(session_id, parent_id, match.matched, ids[match.matched :], logprobs[match.matched - first :], optional, payload, kv)
        metadata = dict(item.metadata, kind="text" if item.text is not None else "chat")
        if item.text is not None and tok.decode(loaded.tokenizer, ids) != item.text:
            # This tokenizer does not round-trip the text; keep it verbatim so `show` stays exact.
            metadata["text"] = item.text
        row = SessionRow(session_id, item.name, item.source, model_id, utc_now(), len(ids), metadata)
        alphabet = max(loaded.model.config.vocab_size, len(loaded.tokenizer))
        return SessionWrite(row, alphabet, split, node, tokens_back=tokens_back), cache

    def _add_tiers(self, loaded, session_id: str, ids: np.ndarray, optional: frozenset[str], cache=None) -> tuple[str, ...]:
        """Give the nodes of the session's path the tiers of ``optional`` they lack, and name
        those tiers: a session archived before with fewer (ingested again after `kvdb codebooks
        train`, or for tier L before `kvdb compact`), or the shared prefix a new session runs
        through (``cache``: its ingest pass's, holding the whole session). A node that holds a
        tier keeps it as it is. Reads first, then the model's work with the file let go; the
        commit is refused if anything landed since the path was read, which is then read again
        (the work is redone only if the path now lacks other tiers)."""
        planned = None  # (what it was planned for, the plan, the nodes joining the index)
        for _ in range(COMMIT_ATTEMPTS):
            self._index_ready(loaded, optional)
            seen = self._storage.version()
            lacking = _lacking(self._storage.node_path(session_id), optional)
            if not lacking:
                return ()
            if planned is None or planned[0] != lacking:
                planned = (lacking, *self._tiers_plan(loaded, ids, self._storage.node_path(session_id), lacking, cache))
            _, plan, joining, cache = planned
            try:
                if joining:
                    tok_hash = loaded.identity.tokenizer_hash
                    self._indexes.commit(index_key(tok_hash), tok_hash, plan, joining, based_on=seen)
                else:
                    self._storage.apply(plan, seen)
                break
            except StaleWrite:  # another writer committed meanwhile: the plan stands if the path lacks the same
                continue
        else:
            raise StaleWrite(f"{COMMIT_ATTEMPTS} commits of tiers for session {session_id[:12]} in a row found another writer's first; run the ingest again")
        return tuple(t for t in TIERS if any(t in tiers for *_, tiers in lacking))

    def _tiers_plan(self, loaded, ids: np.ndarray, path: list[NodeRow], lacking: list[tuple], cache):
        """(the AddTiers plan of ``lacking``, the nodes joining the search index with their tokens
        and the tokens before them, the cache of the whole session if tier K needed one)."""
        missing = {node_id: tiers for node_id, _, _, tiers in lacking}
        nodes = [n for n in path if n.node_id in missing]
        back, lm, kv = ([n for n in nodes if tier in missing[n.node_id]] for tier in ("tokens", "lm", "kv"))
        books = self._tier_k().codebooks(loaded.identity.model_id)[0] if kv else None  # the shipped ones when the archive has none
        scoring = bool(back) or (bool(kv) and cache is None)  # log-probabilities of tokens given back; a cache for tier K
        self._storage.before_compute(short=not lm and not (scoring and len(ids) >= SHORT_WORK_TOKENS))
        given: dict[str, dict] = {n.node_id: {} for n in nodes}
        if scoring:
            first = min((n.start for n in back), default=len(ids))
            logprobs, cache = self._score_suffix(loaded, ids, first, [(n.node_id, n.end) for n in reversed(path)])
            for n in back:
                given[n.node_id]["tokens"] = (ids[n.start : n.end], logprobs[n.start - first : n.end - first])
        for node_id, payload in self._tier_l.encode_nodes(loaded, ids, lm).items():
            given[node_id]["lm"] = payload
        for n in kv:
            given[n.node_id]["kv"] = self._tier_k().codes(loaded, cache, n.start, n.end, codebook_id=books)
        joining = {n.node_id: (ids[n.start : n.end], ids[: n.start]) for n in nodes if "search" in missing[n.node_id]}
        return AddTiers({node_id: NodeTiers(**tiers) for node_id, tiers in given.items() if tiers}), joining, cache

    def _keep_prefix(self, session_id: str, ids: np.ndarray, cache) -> None:
        """Save a growing conversation's cache for later processes, once: a turn that this
        process extends in turn replaces it unsaved; the last is saved on close."""
        pending = self._pending_prefix
        if pending is not None and not (len(ids) > len(pending[1]) and np.array_equal(ids[: len(pending[1])], pending[1])):
            self._prefix_cache.save(pending[0], pending[2])
        self._pending_prefix = (session_id, ids, cache)

    def _score_suffix(self, loaded, ids: np.ndarray, start: int, resumable: list[tuple[str, int]]):
        """Log-probabilities of ids[start:], resuming the shared prefix's cache from the last
        session ingested in this process, else from the prefix cache on disk (the deepest of the
        ``resumable`` path nodes it holds), else prefilling it."""
        from kvdb.model import loading as lm_ops

        fed = start - 1  # the cache to resume holds ids[:fed]; the logits at fed predict ids[start]
        cache, held = None, 0
        if fed > 0 and self._recent is not None and np.array_equal(self._recent[0][:fed], ids[:fed]):
            cache, held = copy.deepcopy(self._recent[1]), len(self._recent[0])
        elif fed > 0:
            held, cache = self._prefix_cache.load(loaded.model, resumable) or (0, None)
        if cache is not None and held > fed:
            cache.crop(fed - held)
        if cache is not None and held < fed:  # held only an earlier turn: compute the rest onto it
            cache = lm_ops.prefill(loaded.model, ids[:fed], cache=cache)
        logprobs, cache = lm_ops.score(loaded.model, ids, start=start, cache=cache)
        self._recent = (ids, cache) if len(ids) <= RECENT_CACHE_TOKENS else None
        return logprobs, cache

    def _session_bytes(self) -> int:
        """The most bytes of a file one session may take: what the model's context can hold, or,
        before the model is loaded, what the longest context of any model can."""
        loaded = self._models.loaded
        return FILE_BYTES_PER_CONTEXT_TOKEN * (self._models.context_tokens(loaded) if loaded is not None else LONGEST_CONTEXT_TOKENS)

    def _render(self, loaded, item) -> np.ndarray:
        """The session's token ids, refused when empty or longer than the model can attend to
        (a cache past its context would restore a state the model was never trained on)."""
        text = item.text if item.text is not None else chat.render(loaded.tokenizer, item.messages)
        ids = np.asarray(tok.encode(loaded.tokenizer, text), dtype=np.int64)
        if len(ids) == 0:
            raise TranscriptError(item.source, "renders to zero tokens; nothing to archive")
        context = self._models.context_tokens(loaded)
        if len(ids) > context:
            raise TranscriptError(
                item.source, f"renders to {len(ids):,} tokens, more than the {context:,} of the model's context; split it into smaller sessions"
            )
        return ids


def _lacking(path: list[NodeRow], optional: frozenset[str]) -> list[tuple]:
    """(node id, start, length, tiers of ``optional`` it lacks) of each path node lacking some:
    what adding tiers depends on (not, say, a node's refcount)."""
    return [(n.node_id, n.start, n.n_tokens, optional - n.keep) for n in path if optional - n.keep]


def _gone_from_here(owner: str) -> bool:
    """Whether a claim's owner (host:pid) is a process of this machine that no longer runs."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _claim_key(path: Path, optional: frozenset[str]) -> str:
    """A file's content and the tiers asked for: the same file under another mount point is the
    same claim; the same file ingested for other tiers is another."""
    digest = hashlib.sha256(",".join(sorted(optional)).encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _match_key(match: trie.PrefixMatch) -> tuple:
    """What a session's write depends on in a prefix match (not, say, the node's refcount)."""
    node = match.node
    return match.matched, match.offset, None if node is None else (node.node_id, node.start, node.n_tokens, node.keep)
