"""Archiving sessions, along one write path: plan, compute, commit.

- **Plan** (``write_plan``): each source is parsed, rendered and tokenized once; each session is
  matched against the trie into the work still to do. No writes, no model.
- **Compute** (``write_compute``): the only place the model runs, with the file let go; it
  takes a caller's own pass (``kvdb serve``'s generation) where one is given.
- **Commit** (here): one retry loop. If another writer changed the trie where the session
  attaches, the plan is made again, and the model's work kept when the plan asks for the same.
  Index slots are assigned inside the commit (``Indexes.commit``).

The writes that make the archive ready for a source (the model's row, tier K's codebooks) are
done once before it, in ``prepare``: no getter writes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdb import transcripts
from kvdb.codecs import presets
from kvdb.codecs.presets import DEFAULT_NAME
from kvdb.errors import EmptyTranscript, InvalidArgument, StaleWrite, TranscriptError
from kvdb.index import trie
from kvdb.index.indexes import Indexes, index_key
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import IngestResult, IngestStatus
from kvdb.services.claims import InputClaims
from kvdb.services.models import ModelProvider
from kvdb.services.tier_l import TierL
from kvdb.services.write_compute import Computed, WriteCompute
from kvdb.services.write_plan import Planned, SessionPlan, plan_parts, plan_session
from kvdb.storage import Storage
from kvdb.storage.base import AddTiers, Queue, SessionWrite
from kvdb.storage.edits import SEMANTIC_WORK
from kvdb.tiers import MODEL_TIERS, TIERS, Tier, parse_keep
from kvdb.transcripts import Transcript
from kvdb.transcripts.redaction import redacted

if TYPE_CHECKING:
    from kvdb.services.tier_k import TierK

# progress(done, planned): tokens just archived, and tokens newly known to be coming (a file's
# sessions are counted once they are tokenized), so a progress bar can show a total.
Progress = Callable[[int, int], None]
Heard = Callable[[list[IngestResult]], None]
# The most bytes of a file one session may take: a session is held in memory whole while it is
# parsed and rendered (a longer one than the model's context is archived in parts), so larger
# ones are refused before they are read.
SESSION_BYTES = 1 << 28
COMMIT_ATTEMPTS = 50  # another writer's commit won each time: past this, say so instead of trying forever


class Ingester:
    def __init__(
        self,
        storage: Storage,
        models: ModelProvider,
        tier_l: TierL,
        tier_k: Callable[[], TierK],
        compute: WriteCompute,
        indexes: Indexes,
        prefix_cache: PrefixCache,
    ):
        self._storage = storage
        self._models = models
        self._tier_l = tier_l
        self._tier_k = tier_k  # built on first use: most ingests keep no tier K
        self._indexes = indexes
        self._prefix_cache = prefix_cache
        self._compute = compute  # shared with ``kvdb upkeep``: the model runs in one place on the write path
        self._heads = trie.Heads()  # nodes' first tokens, read once: a node's children are told apart by them
        self._written = trie.Written()  # the last sessions' paths: a log's next part walks on from its last
        self._claims = InputClaims(storage)
        # (session id, ids, cache, its path's nodes deepest first) of the last growing conversation, saved on close
        self._pending_prefix: tuple[str, np.ndarray, object, list[tuple[str, int]]] | None = None

    def close(self) -> None:
        if self._pending_prefix is not None:
            session_id, _, cache, shorter = self._pending_prefix
            self._prefix_cache.save(session_id, cache, shorter)
            self._pending_prefix = None

    def ingest(
        self,
        source,
        *,
        text: str | None,
        messages: Sequence[dict] | None,
        name: str | None,
        keep,
        progress: Progress | None,
        computed: Computed | None = None,
        keep_cache: bool = False,
        strict: bool = False,
        kv_preset: str = DEFAULT_NAME,
        conversation: str | None = None,
        redact: bool = False,
        heard: Heard | None = None,
        upstream: dict | None = None,
    ) -> list[IngestResult]:
        """``heard``: each file's results once they are committed (a caller that reports as it
        goes: a file archive commits files together, about once a second). ``upstream``: the
        session's ``metadata["upstream"]`` (``Session.upstream``)."""
        if sum(x is not None for x in (source, text, messages)) != 1:
            raise InvalidArgument("give exactly one of: paths, text=, messages=")
        if (computed is not None or conversation is not None or upstream is not None) and source is not None:
            raise InvalidArgument(
                "computed=, conversation= and upstream= go with one session, given as text= or messages="
            )
        self._storage.check_writable()
        optional = parse_keep(keep)
        given = [transcripts.transcript_from_text(text, name or "text")] if text is not None else None
        if messages is not None:
            given = [transcripts.transcript_from_messages(messages, name or "messages")]
        if given is not None and upstream is not None:
            given = [dataclasses.replace(t, metadata={**t.metadata, "upstream": dict(upstream)}) for t in given]
        try:
            if given is not None:
                planned = _planned(given, self._models.described(), redact)
                return self._ingest_source(planned, optional, kv_preset, progress, computed, keep_cache, conversation)
            return self._ingest_paths(
                source, optional, kv_preset, progress, keep_cache, strict, redact, heard or (lambda results: None)
            )
        finally:
            self._storage.release()  # done writing: other processes need not wait for this object's next call

    def _ingest_paths(
        self,
        source,
        optional: frozenset[str],
        kv_preset: str,
        progress: Progress | None,
        keep_cache: bool,
        strict: bool,
        redact: bool,
        heard: Heard,
    ) -> list[IngestResult]:
        paths = [source] if isinstance(source, (str, Path)) else list(source)
        results: list[IngestResult] = []
        found: list[Path] = []
        for given in paths:  # a path that is missing or of no supported kind fails alone; the others still ingest
            try:
                found += transcripts.find_transcript_files([given])
            except TranscriptError as exc:
                results.append(IngestResult(None, Path(given).stem, str(given), 0, IngestStatus.FAILED, str(exc)))
        heard(list(results))  # the paths that failed to be listed
        files = list(dict.fromkeys(found))
        if not files:
            return results
        reader = _FileReader(self._models.described, strict, redact, ahead=not self._claims.needed)
        # files commit together until the lock is let go (HOLD_SECONDS), then each is said
        with self._storage.batch(), reader:
            for at, path in enumerate(files):
                committed = self._ingest_file(
                    path, functools.partial(reader.read, files, at), optional, kv_preset, progress, keep_cache
                )
                self._storage.after_commit(lambda committed=committed: heard(committed))
                results.extend(committed)
        return results

    def _ingest_file(
        self,
        path: Path,
        read: Callable[[], Read],
        optional: frozenset[str],
        kv_preset: str,
        progress: Progress | None,
        keep_cache: bool,
    ) -> list[IngestResult]:
        def archive(progress: Progress | None) -> list[IngestResult]:
            planned, skipped = read()
            try:
                if isinstance(planned, TranscriptError):
                    raise planned
                results = self._ingest_source(planned, optional, kv_preset, progress, keep_cache=keep_cache)
            except EmptyTranscript as exc:
                results = [IngestResult(None, path.stem, str(path), 0, IngestStatus.EMPTY, str(exc))]
            except TranscriptError as exc:
                results = [IngestResult(None, path.stem, str(path), 0, IngestStatus.FAILED, str(exc))]
            return [dataclasses.replace(results[0], skipped=tuple(skipped)), *results[1:]] if skipped else results

        if not self._claims.needed:
            return archive(progress)
        with self._claims.held(path, optional) as (holder, renew):
            if holder is not None:
                return [IngestResult(None, path.stem, str(path), 0, IngestStatus.CLAIMED, claimed_by=holder)]

            def renewing(done: int, planned: int) -> None:
                if not planned and renew is not None:
                    renew()
                if progress:
                    progress(done, planned)

            return archive(renewing)

    def prepare(self, keep, kv_preset: str = DEFAULT_NAME) -> tuple[Any, str | None]:
        """(the model, tier K's codebook id of ``kv_preset`` if ``keep`` asks for tier K): the
        model's description alone where ``keep`` asks for no tier only it makes. The archive's
        writes that come before any session's (the model's row; the shipped codebooks'
        reference, built on this machine's first use), done at once. A server calls it at start,
        to fail there."""
        optional = parse_keep(keep)
        loaded = self._models.get() if optional & MODEL_TIERS else self._models.described()
        presets.resolve(kv_preset, loaded.identity.weights_hash)  # a bad preset refused before any write
        self._models.register()
        books = self._tier_k().ensure_codebooks(loaded.identity.model_id, kv_preset) if "kv" in optional else None
        return loaded, books

    def _ingest_source(
        self,
        planned: list[Planned],
        optional: frozenset[str],
        kv_preset: str,
        progress: Progress | None,
        computed: Computed | None = None,
        keep_cache: bool = False,
        conversation: str | None = None,
    ) -> list[IngestResult]:
        """Archive the sessions of one source, read whole before the first write (``planned``):
        a failure anywhere writes nothing. It was parsed before the model loads, so a malformed
        file is refused in milliseconds."""
        loaded, books = self.prepare(optional, kv_preset)
        model_id = loaded.identity.model_id
        if computed is not None and len(planned) > 1:
            raise InvalidArgument(
                f"a computed pass covers one session within the model's context; this one has {len(planned)} parts"
            )
        if progress:
            progress(0, sum(len(p.ids) for p in planned))
        results = []
        # embedded later, newest first: the embedder's pass is no ingest's
        queued = (SEMANTIC_WORK,) if Tier.SEMANTIC in optional else ()
        # the source's sessions in one transaction (committed early when the lock is let go)
        with self._storage.batch():
            unchanged = self._unchanged(model_id, planned, optional - {Tier.SEMANTIC}, queued)
            for one in planned:
                result = unchanged.get(id(one)) or self._archive(
                    loaded, one, optional - {Tier.SEMANTIC}, books, computed, keep_cache, conversation, queued
                )
                results.append(dataclasses.replace(result, dropped=one.item.dropped) if one.item.dropped else result)
                if progress:
                    progress(len(one.ids), 0)
                self._storage.before_compute(short=True)  # a hold past HOLD_SECONDS lets readers in (and commits)
        return results

    def _unchanged(
        self, model_id: str, planned: list[Planned], keep: frozenset[str], queued: tuple[str, ...]
    ) -> dict[int, IngestResult]:
        """The results of the sessions of ``planned`` archived already with every tier of
        ``keep`` (by ``id()`` of each), found in one read: a watched log past the model's context
        is read again whole at each turn, and all its parts but the last are unchanged. Those
        whose path lacks the semantic tier that ``queued`` asks for are queued for it, as
        ``_archive`` does."""
        began = time.perf_counter()
        ids = {id(one): trie.path_id(model_id, one.ids) for one in planned}
        paths = self._storage.session_paths(list(dict.fromkeys(ids.values()))) if len(planned) > 1 else {}
        done = {key: sid for key, sid in ids.items() if sid in paths and not any(keep - n.keep for n in paths[sid])}
        lacking = [sid for sid in dict.fromkeys(done.values()) if any(Tier.SEMANTIC not in n.keep for n in paths[sid])]
        if SEMANTIC_WORK in queued and lacking:
            self._storage.apply(Queue(lacking, SEMANTIC_WORK))  # archived before without it: embedded later too
        seconds = (time.perf_counter() - began) / max(1, len(done))
        return {
            id(one): IngestResult(
                done[id(one)],
                one.item.name,
                one.item.source,
                len(one.ids),
                IngestStatus.UNCHANGED,
                None,
                0,
                seconds,
                part=one.part.get("number"),
            )
            for one in planned
            if id(one) in done
        }

    def _archive(
        self,
        loaded,
        planned: Planned,
        keep: frozenset[str],
        books: str | None,
        computed: Computed | None,
        keep_cache: bool,
        conversation: str | None,
        queued: tuple[str, ...],
    ) -> IngestResult:
        """Store only what the trie does not hold yet, computing the model only over it; then give
        the session's path the tiers it lacks. One loop: each turn plans against the archive as
        it stands, computes what the plan asks for (unless the last turn's plan asked the same),
        and commits; a commit refused as stale plans again. ``queued``: work left for upkeep."""
        began = time.perf_counter()
        ids, item = planned.ids, planned.item
        model_id = loaded.identity.model_id
        # a part continues the conversation of the part before it
        if conversation is None and planned.part.get("follows") is not None:
            before = self._storage.get_session(planned.part["follows"])
            # ... when that part is this file's own: the same tokens archived from another file (a resumed log's
            # copied history) are that file's session, and this file's conversation is decided by the rule, as a
            # whole session's
            conversation = before.conversation_id if before is not None and before.source == item.source else None
        status, new_tokens, cache = IngestStatus.UNCHANGED, 0, None
        added: tuple[str, ...] = ()
        work = None  # (the plan's key, the edit, the nodes joining the index, the cache)

        # this session's prefix is the context a tier-L node decodes in; its own tokens, how far to decode
        def tokens_of(node):
            return self._tier_l.node_tokens(node, ids[: node.start], like=ids[node.start :])

        for _ in range(COMMIT_ATTEMPTS):
            self._index_ready(loaded, keep)  # a rebuild commits: before the snapshot the plan rests on
            plan = plan_session(self._storage, model_id, ids, keep, tokens_of, self._heads, self._written)
            if plan.done:
                break
            if work is None or work[0] != plan.key:
                edit, joining, cache = self._computed(loaded, plan, planned, books, computed, cache, scored=keep_cache)
                if isinstance(edit, SessionWrite):
                    edit = dataclasses.replace(edit, conversation=conversation, queued=queued)
                work = (plan.key, edit, joining, cache)
            _, edit, joining, cache = work
            try:
                self._commit(loaded, edit, joining, plan.version)
            # another writer committed meanwhile: plan again; the work stands if the plan is the same
            except StaleWrite:
                continue
            work = None
            if isinstance(edit, SessionWrite) and edit.path:
                self._written.wrote(plan.session_id, ids, edit.path)
            if plan.match is not None:
                status, new_tokens = IngestStatus.INGESTED, len(ids) - plan.match.matched
                self._keep_prefix(plan, cache, now=keep_cache)
                if not any(keep - n.keep for n in plan.path):  # its path had every tier asked for: nothing to add
                    break
            else:
                added = tuple(t for t in TIERS if any(t in tiers for _, tiers in plan.lacking))
                status = IngestStatus.UPDATED if status == IngestStatus.UNCHANGED else status
        else:
            raise StaleWrite(
                f"{COMMIT_ATTEMPTS} commits of session {plan.session_id[:12]} in a row found another writer's first; "
                "run the ingest again"
            )
        if (
            status != IngestStatus.INGESTED
            and SEMANTIC_WORK in queued
            and any(Tier.SEMANTIC not in n.keep for n in plan.path)
        ):
            # archived before without it: embedded later too
            self._storage.apply(Queue([plan.session_id], SEMANTIC_WORK))
        seconds = time.perf_counter() - began
        return IngestResult(
            plan.session_id,
            item.name,
            item.source,
            len(ids),
            status,
            None,
            new_tokens,
            seconds,
            added=added if status == IngestStatus.UPDATED else (),
            part=planned.part.get("number"),
        )

    def _computed(
        self,
        loaded,
        plan: SessionPlan,
        planned: Planned,
        books: str | None,
        computed: Computed | None,
        cache,
        scored: bool,
    ) -> tuple:
        """(the edit, the nodes joining the search index, the session's cache) of ``plan``;
        ``scored``: the model's pass made now, not queued (a server keeps each exchange's cache)."""
        if plan.runs_model or scored:
            loaded = self._models.get()
        if plan.match is not None:
            work = self._compute.session(loaded, planned, plan, books, computed, score=scored)
            node = work.write.node
            joining = (
                {node.node_id: (node.tokens, plan.ids[: plan.match.matched])}
                if node is not None and "search" in node.keep
                else {}
            )
            return work.write, joining, work.cache
        return self._compute.tiers(loaded, plan, books, cache)

    def _index_ready(self, loaded, keep: frozenset[str]) -> None:
        """The search index brought up to date (numbered anew, a commit, where it must be)."""
        if "search" in keep:
            tok_hash = loaded.identity.tokenizer_hash
            self._indexes.ready(index_key(tok_hash), tok_hash, _alphabet(loaded))

    def _commit(self, loaded, edit: SessionWrite | AddTiers, joining: dict, based_on) -> None:
        if not joining:
            self._storage.apply(edit, based_on)
        else:
            tok_hash = loaded.identity.tokenizer_hash
            self._indexes.commit(index_key(tok_hash), tok_hash, edit, joining, _alphabet(loaded), based_on)

    def _keep_prefix(self, plan: SessionPlan, cache, now: bool) -> None:
        """A conversation that grows (the session extends an archived one) leaves its cache for
        later processes: saved ``now`` (a server's exchange), else once, when this process is
        done with the conversation (a turn that it extends in turn replaces it unsaved; the
        last is saved on close)."""
        match = plan.match
        assert match is not None
        if cache is None:  # the model did not run: nothing to keep
            return
        grows = (
            match.node is not None
            and match.offset == match.node.n_tokens
            and self._storage.has_session(match.node.node_id)
        )
        if not (grows or now):
            return
        # an entry stores what it adds to its path's
        path = trie.ends_deepest_first(self._storage.node_path(plan.session_id))
        if now:
            self._prefix_cache.save(plan.session_id, cache, path)
            return
        pending, ids = self._pending_prefix, plan.ids
        if pending is not None and not (
            len(ids) > len(pending[1]) and np.array_equal(ids[: len(pending[1])], pending[1])
        ):
            self._prefix_cache.save(pending[0], pending[2], pending[3])
        self._pending_prefix = (plan.session_id, ids, cache, path)


# A file's sessions read and tokenized (or why it cannot be), and the records its reading left out
Read = tuple[list[Planned] | TranscriptError, list[dict] | None]


def _planned(items: Iterable[Transcript], described, redact: bool) -> list[Planned]:
    """Sessions parsed, rendered and tokenized, as the sessions that archive them (``plan_parts``)."""
    tokenizer, model_id, context = described.tokenizer, described.identity.model_id, described.context_tokens
    return [
        part for item in items for part in plan_parts(tokenizer, model_id, redacted(item) if redact else item, context)
    ]


class _FileReader:
    """Files read (parsed, rendered, tokenized) one ahead of their writes, on a thread of their
    own: DuckDB's statements and the tokenizer let go of the GIL, so the next file is read on the
    second core while this one's statements run (decision 0065). A file is parsed before the
    model is looked at (a malformed one is refused without it), so files are read on the
    caller's thread until one tells what the model is. With ``ahead`` false each file is read
    when asked (a worker reads only the files it has claimed)."""

    def __init__(self, describe: Callable[[], Any], strict: bool, redact: bool, ahead: bool):
        self._describe, self._strict, self._redact = describe, strict, redact
        self._described = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvdb-read") if ahead else None
        self._next: tuple[int, Future[Read]] | None = None

    def read(self, files: list[Path], at: int) -> Read:
        ahead, self._next = self._next, None
        read = ahead[1].result() if ahead is not None and ahead[0] == at else self._read(files[at])
        if self._pool is not None and self._described is not None and at + 1 < len(files):
            self._next = (at + 1, self._pool.submit(self._read, files[at + 1]))
        return read

    def _read(self, path: Path) -> Read:
        # malformed records left out, named in the file's first result
        skipped: list[dict] | None = None if self._strict else []
        try:
            items = list(transcripts.iter_transcripts(path, SESSION_BYTES, skipped))
            if self._described is None:  # on the caller's thread: no file is read ahead before this
                self._described = self._describe()
            return _planned(items, self._described, self._redact), skipped
        except TranscriptError as exc:
            return exc, skipped

    def __enter__(self) -> _FileReader:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # a read under way ends first: it writes nothing


def _alphabet(loaded) -> int:
    return max(loaded.vocab_size, len(loaded.tokenizer))
