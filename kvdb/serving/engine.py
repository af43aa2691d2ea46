"""The model behind ``kvdb serve``: completions that resume from what was computed before,
and conversations that end up in the archive.

- A prompt starts from the longest prefix of it already computed: first the caches this
  process holds in memory, then the archive's (its prefix cache of exact caches; tier K, which
  is approximate, with ``restore="archive"``), else nothing; only the rest is computed.
- Each completed exchange goes to the journal before the reply's last bytes are sent; the
  archiver ingests it afterwards, off the response path (``archiver.py``, ``journal.py``).
  An exchange an upstream server answered (``kvdb serve --upstream``) is handed over once its
  reply is sent, and goes the same way (``relay.py``).
- One model, one lock (``gate.py``): generation and the archiver's model work take turns, and
  requests queue for the model in bounded numbers. The archive is used from one thread
  (``access.py``), held only for each call: reads wait for no generation.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvdb import transcripts
from kvdb.archive import Archive
from kvdb.errors import Busy, ContextTooLong, InvalidArgument, KvdbError, ModelMismatch
from kvdb.index.phrase import MIN_SHARE, Hit
from kvdb.model import capture, chat
from kvdb.model import tokenizer as tok
from kvdb.records import (
    Conversation,
    ConversationHistory,
    ConversationPage,
    DeletedConversation,
    PhraseCount,
    Session,
    Stats,
)
from kvdb.services.journal import Journal
from kvdb.serving.access import ArchiveAccess
from kvdb.serving.archiver import Archiver
from kvdb.serving.gate import ModelGate
from kvdb.serving.generation import Generation
from kvdb.serving.params import Request
from kvdb.serving.recent import DEFAULT_BUDGET_BYTES, RecentCaches
from kvdb.serving.relay import Relay, Relayed, title_of
from kvdb.serving.reply import Reply
from kvdb.serving.responses import Completion, Embeddings, Header, SessionView
from kvdb.tiers import DEFAULT_KEEP, DEFAULT_KV_PRESET, DEFAULT_MAX_LOSS, check_max_loss

DEFAULT_MAX_TOKENS = 512  # a request that names no max_tokens: as many as the context holds, up to this
RESTORE_MODES = ("exact", "auto", "archive")
# Reading a position of the archive's exact cache costs about 1/32 of computing one more token
# at the end of a prompt (SmolLM2 on 2 cores, decision 0032)
ARCHIVE_READ_PER_TOKEN = 32


@dataclass(frozen=True)
class Start:
    """Where a prompt's computation begins: ``cache`` holds its first ``held`` tokens."""

    cache: object  # None: nothing held
    held: int
    approximate: bool  # tier K somewhere in the cache's making
    cached: int  # tokens not computed for this prompt (tier K's recomputed window is computed)
    fidelity: str | None = None  # a restore from tier K: what its preset was measured to cost

    @property
    def restored(self) -> str:
        return "none" if not self.held else "archive" if self.approximate else "exact"


@dataclass(frozen=True)
class Prompt:
    ids: np.ndarray
    name: str
    kind: str  # what the archived exchange is ingested from: "messages" or "text"
    exchange: Callable[[str], object]  # the reply -> what is ingested
    conversation: str | None  # the one it continues or starts; None: the one whose archived session it extends

    def entry(self, reply: str) -> dict:
        return {
            "kind": self.kind,
            "content": self.exchange(reply),
            "name": self.name,
            "conversation": self.conversation,
        }


class Engine:
    def __init__(
        self,
        archive: Archive,
        keep: str = DEFAULT_KEEP,
        restore: str = "exact",
        queue: int = 8,
        queue_timeout: float = 600.0,
        cache_bytes: int = DEFAULT_BUDGET_BYTES,
        kv_preset: str = DEFAULT_KV_PRESET,
        max_loss: float = DEFAULT_MAX_LOSS,
    ):
        """``archive``: opened for writing; the engine closes it. ``keep``: the tiers each
        exchange is archived with (tier K coded with ``kv_preset``). ``restore="archive"`` lets
        prompts resume from tier K; ``"auto"`` only where its preset is measured within
        ``max_loss`` (as ``kvdb restore``'s auto)."""
        if restore not in RESTORE_MODES:
            raise InvalidArgument(f"unknown restore mode {restore!r}; choose from {', '.join(RESTORE_MODES)}")
        self._max_loss = check_max_loss(max_loss)
        if queue < 0 or queue_timeout < 0:
            raise InvalidArgument(f"the queue's size and timeout must be >= 0, got {queue} and {queue_timeout}")
        self._keep = keep
        self._restore = restore
        self._access = ArchiveAccess(archive)
        try:
            # a bad keep refused, tier K's codebooks built, at start: not at each exchange
            self._access(lambda a: a.check_keep(keep, kv_preset))
        except KvdbError:
            self._access.close()
            raise
        self.model_name = archive.model_name
        self.embedder_name = archive.embedder_name
        self._loaded = self._access(lambda a: a.loaded_model)
        self.context = archive.context_tokens
        self._gate = ModelGate(queue, queue_timeout)
        self._recent = RecentCaches(cache_bytes)
        self._stopping = threading.Event()
        self._journal = Journal.beside(archive.local_path)
        self._archiver = Archiver(self._journal, self._access, self._gate, keep, kv_preset)
        self._relay = Relay(self._journal.write, self._archiver.submit, self.model_name)

    def start(self) -> None:
        """Start archiving, beginning with the exchanges an earlier run left in the journal."""
        self._archiver.start()
        self._relay.start()

    def stop(self) -> None:
        """Cancel replies in progress (they stop at their next token) and refuse new ones."""
        self._stopping.set()
        self._gate.closed = True

    def close(self) -> None:
        """Stop; journal the relayed exchanges handed over; let the archiver finish the entry in
        hand (the rest stay in the journal); close the archive."""
        self.stop()
        self._relay.stop()
        self._archiver.stop()
        self._access.close()

    # completions ----------------------------------------------------------------------
    def relaying(self) -> Callable[[], None]:
        """A request relayed to an upstream begins: the archiver's work waits until none has been
        in flight for a moment, as for requests of the model (it may share the machine). Returns
        what ends it (once)."""
        return self._gate.relaying()

    def relayed(self, exchange: Relayed) -> None:
        """Archive an exchange an upstream server answered (its reply sent already): queued
        here, journalled and archived on the engine's threads; a failure there is logged, never raised."""
        self._relay.submit(exchange)

    def complete(self, request: Request) -> Reply:
        """Start a reply (refused at once with ``Busy`` when the model's queue is full)."""
        prompt = self._prompt(request)
        max_tokens = self._room(len(prompt.ids), request.sampling.max_tokens)
        release = self._gate.admit()
        header = Header(
            f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}",
            int(time.time()),
            request.model or self.model_name,
            request.chat,
        )
        return Reply(
            header, lambda emit, cancelled: self._reply(header, prompt, request, max_tokens, emit, cancelled, release)
        )

    def _reply(
        self, header: Header, prompt: Prompt, request: Request, max_tokens: int, emit, cancelled, release
    ) -> Completion:
        try:
            start = self._start(prompt.ids, len(prompt.ids) - 1, self._restore)
            generation = Generation(
                self._loaded,
                start.cache,
                prompt.ids,
                request.sampling,
                max_tokens,
                lambda: cancelled() or self._stopping.is_set(),
                request.logprobs,
            )
            for delta in generation.deltas():
                emit(delta)
            if generation.finish_reason == "cancelled":
                raise Busy("the reply was cancelled: the client went away, or the server is shutting down")
            self._recent.put(generation.fed, generation.cache, start.approximate)
            # durable before the reply is; generation's pass handed over unless a tier-K restore made it inexact
            self._archiver.submit(
                self._journal.write(prompt.entry(generation.text)), None if start.approximate else generation.computed
            )
        finally:
            release()
        return Completion(
            header,
            generation.text,
            generation.finish_reason,
            len(prompt.ids),
            len(generation.tokens),
            start.cached,
            start.restored,
            start.approximate,
            tuple(generation.logprobs) if request.logprobs is not None else None,
            start.fidelity,
            prompt.conversation,
        )

    def _start(self, ids: np.ndarray, limit: int, mode: str) -> Start:
        """The longest of the first ``limit`` tokens of ``ids`` whose cache this process holds,
        or the archive gives back; else an empty cache."""
        hit = self._recent.best(ids, limit, exact_only=mode == "exact")
        held = hit[0] if hit is not None else 0
        # Past a hit in memory, the archive's cache must hold enough more to pay for reading all
        # of it: its last exchange ends a few tokens past what generation fed, and reading all its
        # positions back took far longer than computing those few tokens (decision 0032).
        # An approximate hit (tier K in its making) takes the archive's exact cache however short its gain.
        worth = held + limit // ARCHIVE_READ_PER_TOKEN if hit is not None and not hit[2] else held
        # The archive is not waited for while it is busy (archiving, most likely, this process's
        # last exchange, which the hit in memory holds already): a follow-up starts at once.
        ask = worth < limit and not (hit is not None and self._access.busy)
        found = (
            self._access(lambda a: a.resume(ids[:limit], better_than=worth, mode=mode, max_loss=self._max_loss))
            if ask
            else None
        )
        if found is not None:
            approximate = found.mode == "archive"
            fidelity = found.fidelity.summary if found.fidelity is not None else None
            return Start(
                found.cache,
                found.position,
                approximate,
                found.position - (capture.SINKS + capture.RECENT if approximate else 0),
                fidelity,
            )
        if hit is not None:
            return Start(hit[1], held, hit[2], held)
        return Start(None, 0, False, 0)

    def _prompt(self, request: Request) -> Prompt:
        """The request's token ids, and what its exchange is archived as."""
        tokenizer = self._loaded.tokenizer
        sent, prompt, ref = request.messages, request.prompt, request.session  # exactly one of sent and prompt is None
        messages: list[dict] = []
        if sent is not None:
            transcript = transcripts.transcript_from_messages(sent)
            assert transcript.messages is not None  # a chat transcript holds messages
            messages = list(transcript.messages)
        if ref is None:
            # a chat of one turn starts a conversation; a longer one sent whole joins the one whose archived session it
            # extends
            opens = request.conversation or (
                uuid.uuid4().hex if sent is None or not any(m["role"] == "assistant" for m in messages) else None
            )
            if sent is not None:
                ids = np.asarray(
                    tok.encode(tokenizer, chat.render(tokenizer, messages, add_generation_prompt=True)), dtype=np.int64
                )
                users = [m["content"] for m in messages if m["role"] == "user"] or [messages[0]["content"]]
                return Prompt(
                    ids,
                    request.name or title_of(users[0], "chat"),
                    "messages",
                    lambda reply: [*sent, {"role": "assistant", "content": reply}],
                    opens,
                )
            assert prompt is not None
            ids = np.asarray(tok.encode(tokenizer, prompt), dtype=np.int64)
            return Prompt(
                ids, request.name or title_of(prompt, "completion"), "text", lambda reply: prompt + reply, opens
            )
        session, before, before_text = self._access(lambda a: self._archived_prefix(a, ref, request.at))
        added = chat.turns_suffix(tokenizer, messages) if prompt is None else prompt
        ids = np.concatenate([before, np.asarray(tok.encode(tokenizer, added), dtype=np.int64)])

        # the continued session's text, the new turns and the reply, as one text session
        def exchange(reply: str) -> str:
            if prompt is not None:
                return before_text + prompt + reply
            return before_text + chat.turns_suffix(
                tokenizer, [*messages, {"role": "assistant", "content": reply}], add_generation_prompt=False
            )

        # a continuation is a later version of the session's conversation; from before its end, a fork of it
        return Prompt(
            ids, request.name or session.name, "text", exchange, request.conversation or session.conversation_id
        )

    def _archived_prefix(self, archive: Archive, ref: str, at: int | None) -> tuple[Session, np.ndarray, str]:
        session = archive.session(ref)
        if session.model_id != self._loaded.identity.model_id:
            raise ModelMismatch(
                f"session {session.session_id[:12]} ({session.name}) was archived with another model than "
                f"{self.model_name!r}, which this server runs; serve it with that session's --model"
            )
        at = session.n_tokens if at is None else at
        return session, archive.tokens(session.session_id, 0, at), archive.text(session.session_id, 0, at)

    def _room(self, prompt_tokens: int, asked: int | None) -> int:
        """How many tokens the reply may take: ``asked`` (default: what the context holds, up
        to DEFAULT_MAX_TOKENS), refused when the prompt and the reply would not fit."""
        room = self.context - prompt_tokens
        wanted = min(DEFAULT_MAX_TOKENS, room) if asked is None else asked
        if room < 1 or wanted > room:
            more = f" and asks for up to {asked:,} more" if asked is not None else ""
            raise ContextTooLong(
                f"the prompt has {prompt_tokens:,} tokens{more}, over the model's context of {self.context:,} tokens; "
                f"shorten the messages{' or lower max_tokens' if asked is not None else ''}"
            )
        return wanted

    # reads: the archive only, never the model (search by meaning runs the embedder, not the model) ------
    def read(self, read):
        """``read(archive)`` on the archive's thread, as every read here is (`kvdb serve`'s MCP
        tools read through it)."""
        return self._access(read)

    def sessions(self) -> list[Session]:
        """Every stored session: each version of each conversation."""
        return self._access(lambda a: a.sessions())

    def conversations(
        self,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
    ) -> list[Conversation]:
        return self._access(lambda a: a.conversations(agent, project, since, until))

    def conversation_page(
        self,
        agent: str | None = None,
        project: str | None = None,
        since: dt.date | None = None,
        until: dt.date | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> ConversationPage:
        return self._access(lambda a: a.conversation_page(agent, project, since, until, limit, offset))

    def conversation(self, ref: str) -> ConversationHistory:
        return self._access(lambda a: a.conversation(ref))

    def rename(self, ref: str, title: str | None) -> Conversation:
        return self._access(lambda a: a.rename(ref, title))

    def delete_conversation(self, ref: str) -> DeletedConversation:
        return self._access(lambda a: a.delete_conversation(ref))

    def view(self, ref: str, start: int | None = None, end: int | None = None) -> SessionView:
        def read(archive: Archive) -> SessionView:
            session = archive.session(ref)
            turns = archive.turns(session.session_id, start, end)
            text = archive.text(session.session_id, start, end)
            return SessionView(
                session, 0 if start is None else start, session.n_tokens if end is None else end, text, turns
            )

        return self._access(read)

    def search(
        self,
        phrase: str,
        k: int = 10,
        semantic: bool = False,
        case_sensitive: bool = False,
        min_share: float = MIN_SHARE,
        each_occurrence: bool = False,
    ) -> list[Hit]:
        if not semantic:
            return self._access(
                lambda a: a.search(
                    phrase, k=k, case_sensitive=case_sensitive, min_share=min_share, each_occurrence=each_occurrence
                )
            )
        return self._access(lambda a: a.search_meaning(phrase, k=k))

    def count(self, phrase: str, case_sensitive: bool = False) -> PhraseCount:
        return self._access(lambda a: a.count(phrase, case_sensitive=case_sensitive))

    def embeddings(self, texts: list[str], encoding: str = "float") -> Embeddings:
        """The semantic tier's vectors of ``texts``: the embedder runs on the archive's thread, not the model's."""
        vectors, tokens = self._access(lambda a: a.embed(texts))
        return Embeddings(self.embedder_name, vectors, tokens, encoding)

    def stats(self) -> Stats:
        return self._access(lambda a: a.stats())
