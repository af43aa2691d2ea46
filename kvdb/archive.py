"""Archive: the one object users and the CLI talk to.

It ties the store (what is kept), the model (what computes) and the transcript parsers
(what comes in) together. The model is loaded lazily: listing, showing, deleting and
stats never pay for it.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import platformdirs

from kvdb import capture, lmcode, quant
from kvdb import model as lm_ops
from kvdb import restore as restore_ops
from kvdb import search as search_ops
from kvdb import semantic as semantic_ops
from kvdb import transcripts, trie
from kvdb import verify as verify_ops
from kvdb.errors import AmbiguousSession, InvalidArgument, ModelMismatch, SessionNotFound, TranscriptError
from kvdb.index import Indexes, SlotMap
from kvdb.model import LoadedModel
from kvdb.prefix_cache import PrefixCache
from kvdb.restore import RestoredSession
from kvdb.search import Hit
from kvdb.store import ModelRow, NewNode, NodeRow, SessionRow, SessionWrite, Split, Store

# progress(done, planned): tokens just archived, and tokens newly known to be coming (a file's
# sessions are counted when its check pass ends), so a progress bar can show a total.
Progress = Callable[[int, int], None]
TIERS = ("tokens", "search", "lm", "kv")
RESTORE_MODES = ("auto", "exact", "archive", "decode")
DEFAULT_KEEP = "tokens,search"  # tier L codes ~10 tokens/s on 2 cores: opt in with --keep tokens,search,lm
DEFAULT_CONTEXT_TOKENS = 8192  # for a model config that does not say
# A session can hold at most the model's context; no session file can fit it with more than this
# many bytes per context token (SmolLM2's longest token is 81 bytes, and JSON escapes take at
# most 6 bytes a byte), so larger sessions are refused before they are read into memory.
FILE_BYTES_PER_CONTEXT_TOKEN = 1024
# Ingest lets the file go during the model's work, unless the work is short (fewer new tokens
# than this, ~0.3 s on 2 cores) and the file has been held for less than HOLD_SECONDS: readers
# then wait at most about a second, and a stream of short sessions does not pay a reconnect each.
SHORT_WORK_TOKENS = 128
HOLD_SECONDS = 1.0
RECENT_CACHE_TOKENS = 8192  # the last session's cache is kept for reuse up to this length (~46 KB/token for SmolLM2)


@dataclass(frozen=True)
class Session:
    session_id: str
    name: str
    source: str
    n_tokens: int
    created_at: dt.datetime
    model_id: str
    metadata: dict = field(repr=False)

    def to_dict(self) -> dict:
        return {"session_id": self.session_id, "name": self.name, "n_tokens": self.n_tokens, "created_at": self.created_at.isoformat()}


@dataclass(frozen=True)
class IngestResult:
    session_id: str | None
    name: str
    source: str
    n_tokens: int
    status: str  # "ingested" | "unchanged" | "failed"
    error: str | None = None
    new_tokens: int = 0  # tokens stored (and computed) anew: the rest was a prefix archived already
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = {"session_id": self.session_id, "name": self.name, "source": self.source, "n_tokens": self.n_tokens, "status": self.status}
        if self.status == "ingested":
            out.update(new_tokens=self.new_tokens, seconds=round(self.seconds, 4))
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class Stats:
    sessions: int
    tokens: int  # summed over sessions
    stored_tokens: int  # stored once, after prefix sharing
    nodes: int
    bytes: dict
    bytes_per_token: dict
    kv_ratio_vs_fp16: float | None = None  # fp16 KV bytes/token of the model / bytes_per_token["kv"]
    codebook_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prefix:
    """A token prefix that several sessions share, stored once."""

    node_id: str
    tokens: int  # length of the shared prefix
    bits: float  # its information content under the model, d_T = -log2 P(prefix)
    sessions: int
    text: str  # its first words

    def to_dict(self) -> dict:
        return {"node_id": self.node_id, "tokens": self.tokens, "bits": round(self.bits, 2), "sessions": self.sessions, "text": self.text}


def default_path() -> Path:
    """``$KVDB_DB``, else ``archive.duckdb`` in the user data directory."""
    return Path(os.environ.get("KVDB_DB") or Path(platformdirs.user_data_dir("kvdb")) / "archive.duckdb")


def open(path: str | Path | None = None, model: str | None = None, read_only: bool = False) -> Archive:  # noqa: A001 (mirrors builtins.open on purpose)
    return Archive(path, model, read_only)


class Archive:
    """An archive file. Several read-only Archives (processes) may read one file at once; a
    writing one excludes them only while it touches the file, not while its model computes."""

    def __init__(self, path: str | Path | None = None, model: str | None = None, read_only: bool = False):
        self.path = Path(path) if path is not None else default_path()
        self.model_name = lm_ops.model_name(model)
        self._store = Store(self.path, read_only=read_only)
        self._lm: LoadedModel | None = None
        self._tokenizer = None  # (tokenizer, hash) when only the tokenizer was needed
        self._indexes = Indexes(self._store, self.path)
        self._prefix_cache = PrefixCache(self.path)
        self._pending_prefix = None  # (session id, ids, cache) of the last growing conversation, saved on close
        self._search_cache: dict[str, tuple] = {}  # by index key: what search reads, until the archive changes
        self._search_epoch = 0  # the store connection the search cache was read on
        self._recent = None  # (ids, cache) of the last session scored, for the next one's shared prefix
        self._recent_lm = None  # (ids, lmcode.Context) after the last session coded in tier L
        self._codebook_cache: dict[str, quant.Codebooks] = {}
        self._decoded: dict = {}  # tokens decoded from tier L: by session id, or by (node id, start, length)

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pending_prefix is not None:
            self._prefix_cache.save(self._pending_prefix[0], self._pending_prefix[2])
            self._pending_prefix = None
        self._store.close()

    @property
    def lm(self) -> LoadedModel:
        """The archive's model, loaded on first use and registered in the archive."""
        if self._lm is None:
            self._store.release()  # loading takes seconds (a first conversion, tens): nobody waits on the file meanwhile
            self._lm = lm_ops.load(self.model_name)
            if not self._store.read_only:  # a model is registered by the first write that uses it
                self._store.put_model(ModelRow(**asdict(self._lm.identity)))
        return self._lm

    # ingest ---------------------------------------------------------------------------
    def ingest(
        self,
        source: str | Path | Iterable[str | Path] | None = None,
        *,
        text: str | None = None,
        messages: Sequence[dict] | None = None,
        name: str | None = None,
        keep: str | Iterable[str] = DEFAULT_KEEP,
        progress: Progress | None = None,
    ) -> list[IngestResult]:
        """Archive transcripts from files/directories (``source``), a ``text``, or a ``messages`` list.

        A file that fails to parse is reported as ``failed`` and writes nothing; the others still
        ingest. Sessions already archived (same model, same tokens) are reported ``unchanged``.
        """
        if sum(x is not None for x in (source, text, messages)) != 1:
            raise InvalidArgument("give exactly one of: paths, text=, messages=")
        self._store.check_writable()
        optional = parse_keep(keep)
        if text is not None:
            return self._ingest_source(lambda: [transcripts.transcript_from_text(text, name or "text")], optional, progress)
        if messages is not None:
            return self._ingest_source(lambda: [transcripts.transcript_from_messages(messages, name or "messages")], optional, progress)
        paths = [source] if isinstance(source, (str, Path)) else list(source)
        results: list[IngestResult] = []
        for path in transcripts.find_transcript_files(paths):
            try:
                limit = FILE_BYTES_PER_CONTEXT_TOKEN * self._context_tokens(self.lm)
                results.extend(self._ingest_source(lambda p=path: transcripts.iter_transcripts(p, limit), optional, progress))
            except TranscriptError as exc:
                results.append(IngestResult(None, Path(path).stem, str(path), 0, "failed", str(exc)))
        return results

    def _ingest_source(self, sessions: Callable[[], Iterable], optional: frozenset[str], progress: Progress | None) -> list[IngestResult]:
        """Archive the sessions of one source in two passes over it, so that memory holds one
        session at a time however large the file: the first checks every session (a failure
        anywhere writes nothing), the second archives them one by one."""
        lm = self.lm
        planned = sum(len(self._render(lm, item)) for item in sessions())
        if progress:
            progress(0, planned)
        results = []
        try:
            for item in sessions():
                ids = self._render(lm, item)
                results.append(self._ingest_one(lm, item, ids, optional))
                if progress:
                    progress(len(ids), 0)
        finally:
            self._store.release()  # done writing: other processes need not wait for this object's next call
        return results

    @staticmethod
    def _context_tokens(lm: LoadedModel) -> int:
        return int(getattr(lm.model.config, "max_position_embeddings", None) or DEFAULT_CONTEXT_TOKENS)

    def _ingest_one(self, lm: LoadedModel, item, ids: np.ndarray, optional: frozenset[str]) -> IngestResult:
        """Store only what the trie does not hold yet, computing the model only over it.

        The file is let go while the model works, so readers and other writers get in; if one
        of them changed the trie where this session attaches, the work is redone against it.
        """
        began = time.perf_counter()
        model_id = lm.identity.model_id
        session_id = trie.path_id(model_id, ids)
        def tokens_of(node: NodeRow) -> np.ndarray:  # this session's prefix is the context a tier-L node decodes in
            return self._node_tokens(node, ids[: node.start])

        while True:
            if self._store.has_session(session_id):
                return IngestResult(session_id, item.name, item.source, len(ids), "unchanged")
            match = trie.longest_prefix(self._store, model_id, ids, tokens_of)
            grows = match.node is not None and match.offset == match.node.n_tokens and self._store.has_session(match.node.node_id)
            planned_on = self._store.connections
            write, cache = self._session_write(lm, item, session_id, ids, match, optional)
            if self._store.unchanged_since(planned_on):
                break
            again = trie.longest_prefix(self._store, model_id, ids, tokens_of)
            if not self._store.has_session(session_id) and _match_key(again) == _match_key(match):
                break
        self._changed()
        if write.node is None or "search" not in write.node.keep:
            self._store.write_session(write)
        else:
            tok_hash = lm.identity.tokenizer_hash
            self._indexes.write_session(index_key(tok_hash), tok_hash, write, ids[: match.matched])
        if "kv" in optional:
            self._complete_kv(lm, session_id, ids, cache)
        if grows and cache is not None:  # a conversation that grows: its next turn may come in another process
            self._keep_prefix(session_id, ids, cache)
        return IngestResult(session_id, item.name, item.source, len(ids), "ingested", None, len(ids) - match.matched, time.perf_counter() - began)

    def _session_write(self, lm: LoadedModel, item, session_id: str, ids: np.ndarray, match: trie.PrefixMatch, optional: frozenset[str]):
        """(what the session adds to the store, the model's cache over it): reads first, then
        the model's work with the file let go."""
        model_id = lm.identity.model_id
        split_tokens = None
        if match.node is not None and match.offset < match.node.n_tokens and "lm" in match.node.keep:
            split_tokens = self._node_tokens(match.node, ids[: match.node.start])
        if "kv" in optional:
            self._codebooks(model_id)
        on_path = self._store.node_path(match.node.node_id) if match.node is not None else []
        resumable = [n.node_id for n in reversed(on_path)]
        # a node held in tier L only that this session now shares gets its tokens back, from the session's own
        back = [n for n in on_path if "tokens" not in n.keep and n.end <= match.matched]
        first = min((n.start for n in back), default=match.matched)  # scored from here: those nodes need log-probabilities
        if len(ids) - first >= SHORT_WORK_TOKENS or "lm" in optional or self._store.held_for() >= HOLD_SECONDS:
            self._store.release()  # reconnecting costs ~30 ms: short work in a fresh hold keeps the file
        split, parent_id, node, lm_context = None, None, None, None
        if match.node is not None and match.offset < match.node.n_tokens:
            parent_id = trie.path_id(model_id, ids[: match.matched])
            split, lm_context = self._split(lm, match, ids, parent_id, split_tokens)
        elif match.node is not None:
            parent_id = match.node.node_id
        cache, tokens_back = None, {}
        if first < len(ids):
            logprobs, cache = self._score_suffix(lm, ids, first, resumable)
            tokens_back = {n.node_id: (ids[n.start : n.end], logprobs[n.start - first : n.end - first]) for n in back}
        if match.matched < len(ids):
            payload = self._lm_code(lm, ids, match.matched, lm_context) if "lm" in optional else None
            kv = self._kv_codes(lm, cache, match.matched) if "kv" in optional else None
            node = NewNode(session_id, parent_id, match.matched, ids[match.matched :], logprobs[match.matched - first :], optional, payload, kv)
        metadata = dict(item.metadata, kind="text" if item.text is not None else "chat")
        if item.text is not None and lm_ops.decode_tokens(lm.tokenizer, ids) != item.text:
            # This tokenizer does not round-trip the text; keep it verbatim so `show` stays exact.
            metadata["text"] = item.text
        row = SessionRow(session_id, item.name, item.source, model_id, _now(), len(ids), metadata)
        alphabet = max(lm.model.config.vocab_size, len(lm.tokenizer))
        return SessionWrite(row, alphabet, split, node, tokens_back=tokens_back), cache

    def _keep_prefix(self, session_id: str, ids: np.ndarray, cache) -> None:
        """Save a growing conversation's cache for later processes, once: a turn that this
        process extends in turn replaces it unsaved; the last is saved on close."""
        pending = self._pending_prefix
        if pending is not None and not (len(ids) > len(pending[1]) and np.array_equal(ids[: len(pending[1])], pending[1])):
            self._prefix_cache.save(pending[0], pending[2])
        self._pending_prefix = (session_id, ids, cache)

    def _complete_kv(self, lm: LoadedModel, session_id: str, ids: np.ndarray, cache) -> None:
        """Shared prefix nodes stored before without tier K get it from this ingest's cache (it
        holds the whole session; a session that added no node prefills one), so the new session
        restores from the archive end to end."""
        missing = [n for n in self._store.node_path(session_id) if "kv" not in n.keep]
        if missing and cache is None:
            cache = lm_ops.prefill(lm.model, ids)
        for node in missing:
            codebook_id, streams = self._kv_codes(lm, cache, node.start, node.end)
            self._store.add_kv(node.node_id, codebook_id, streams)

    def _split(self, lm: LoadedModel, match: trie.PrefixMatch, ids: np.ndarray, head_id: str, tokens: np.ndarray | None):
        """Cut the node the new session diverges in; a node with tier L (its ``tokens`` given)
        gets both halves re-coded (a range-coded stream cannot be cut), which also yields the
        context after the head."""
        node = match.node
        if "lm" not in node.keep:
            return Split(node.node_id, head_id, match.offset), None
        parent = self._lm_context(lm, ids, node.start)
        head, after_head = lmcode.encode_with_context(lm.model, tokens[: match.offset], context=parent)
        tail = lmcode.encode(lm.model, tokens[match.offset :], context=after_head)
        if "tokens" in node.keep:
            return Split(node.node_id, head_id, match.offset, head, tail), after_head
        logprobs, _ = lm_ops.score(lm.model, np.concatenate([ids[: node.start], tokens]), start=node.start)
        return Split(node.node_id, head_id, match.offset, head, tail, tokens, logprobs), after_head

    def _lm_code(self, lm: LoadedModel, ids: np.ndarray, start: int, context) -> bytes:
        """Tier L of ids[start:] given the context of ids[:start] (the previous session's, when it
        ended exactly there, as a conversation ingested turn by turn does; else recomputed)."""
        context = context if context is not None else self._lm_context(lm, ids, start)
        payload, after = lmcode.encode_with_context(lm.model, ids[start:], context=context)
        self._recent_lm = (ids, after) if len(ids) <= RECENT_CACHE_TOKENS else None
        return payload

    def _lm_context(self, lm: LoadedModel, ids: np.ndarray, length: int):
        if length == 0:
            return None
        if self._recent_lm is not None and len(self._recent_lm[0]) == length and np.array_equal(self._recent_lm[0], ids[:length]):
            return self._recent_lm[1]
        return lmcode.context_for(lm.model, ids[:length])

    def _kv_codes(self, lm: LoadedModel, cache, start: int, end: int | None = None) -> tuple[str, dict[int, np.ndarray]]:
        """Tier K of positions [start, end) from the ingest pass's own cache: keys rotated back to
        pre-RoPE, quantized with the model's newest codebooks, as token-major code streams."""
        codebook_id, books = self._codebooks(lm.identity.model_id)
        keys, values = capture.cache_arrays(cache, start, end)
        if books.pre_rope:
            keys = capture.apply_rope(lm.model, keys, start, inverse=True)
        return codebook_id, quant.code_streams(books, quant.encode(books, keys, values))

    def _codebooks(self, model_id: str, codebook_id: str | None = None) -> tuple[str, quant.Codebooks]:
        if codebook_id is None:
            found = self._store.codebooks_for(model_id)
            if found is None:
                raise InvalidArgument("no KV codebooks for this model yet: archive some sessions, then run `kvdb codebooks train`")
            codebook_id = found[0]
        if codebook_id not in self._codebook_cache:
            self._codebook_cache[codebook_id] = quant.Codebooks.from_bytes(self._store.codebook_data(codebook_id))
        return codebook_id, self._codebook_cache[codebook_id]

    def train_codebooks(self, preset: str = quant.DEFAULT_PRESET, tokens: int = 8192, niter: int = 12) -> dict:
        """Residual-VQ codebooks for the archive's model, trained on its own archived sessions
        (oldest first, up to ``tokens`` positions; attention sinks left out: they are recomputed)."""
        lm = self.lm
        start = time.perf_counter()
        keys, values, used = [], [], 0
        for row in self._store.list_sessions():
            if row.model_id != lm.identity.model_id or used >= tokens:
                continue
            ids = self._path_tokens(row, 0, min(row.n_tokens, tokens - used + capture.SINKS))
            k, v = capture.capture(lm.model, ids, pre_rope=True)
            keys.append(k[:, :, capture.SINKS :])
            values.append(v[:, :, capture.SINKS :])
            used += k.shape[2] - capture.SINKS
        largest = max(size for kind in quant.allocation(preset, lm.model.config.num_hidden_layers).values() for stage in kind for size in stage)
        if used < largest:
            raise InvalidArgument(f"training {preset} codebooks needs at least {largest} archived positions; this archive has {used}")
        books = quant.train(
            {"k": np.concatenate(keys, axis=2), "v": np.concatenate(values, axis=2)}, preset, pre_rope=True, niter=niter,
            meta={"model_id": lm.identity.model_id, "tokens": used},
        )
        data = books.to_bytes()
        codebook_id = hashlib.sha256(data).hexdigest()[:32]
        self._store.put_codebooks(codebook_id, lm.identity.model_id, preset, data)
        return {"codebook_id": codebook_id, "preset": preset, "tokens": used, "bytes": len(data), "seconds": round(time.perf_counter() - start, 2)}

    def _score_suffix(self, lm: LoadedModel, ids: np.ndarray, start: int, resumable: list[str]):
        """Log-probabilities of ids[start:], resuming the shared prefix's cache from the last
        session ingested in this process, else from the prefix cache on disk (the deepest of the
        ``resumable`` path nodes it holds), else prefilling it."""
        fed = start - 1  # the cache to resume holds ids[:fed]; the logits at fed predict ids[start]
        cache, held = None, 0
        if fed > 0 and self._recent is not None and np.array_equal(self._recent[0][:fed], ids[:fed]):
            cache, held = copy.deepcopy(self._recent[1]), len(self._recent[0])
        elif fed > 0:
            held, cache = self._prefix_cache.load(lm.model, resumable) or (0, None)
        if cache is not None and held > fed:
            cache.crop(fed - held)
        if cache is not None and held < fed:  # held only an earlier turn: compute the rest onto it
            cache = lm_ops.prefill(lm.model, ids[:fed], cache=cache)
        logprobs, cache = lm_ops.score(lm.model, ids, start=start, cache=cache)
        self._recent = (ids, cache) if len(ids) <= RECENT_CACHE_TOKENS else None
        return logprobs, cache

    @classmethod
    def _render(cls, lm: LoadedModel, item) -> np.ndarray:
        """The session's token ids, refused when empty or longer than the model can attend to
        (a cache past its context would restore a state the model was never trained on)."""
        text = item.text if item.text is not None else lm_ops.render_messages(lm.tokenizer, item.messages)
        ids = np.asarray(lm_ops.encode_text(lm.tokenizer, text), dtype=np.int64)
        if len(ids) == 0:
            raise TranscriptError(item.source, "renders to zero tokens; nothing to archive")
        if len(ids) > cls._context_tokens(lm):
            raise TranscriptError(
                item.source,
                f"renders to {len(ids):,} tokens, more than the {cls._context_tokens(lm):,} of the model's context; "
                "split it into smaller sessions",
            )
        return ids

    # reading --------------------------------------------------------------------------
    def sessions(self) -> list[Session]:
        return [_session(r) for r in self._store.list_sessions()]

    def session(self, ref: str) -> Session:
        """A session by full id, unique id prefix, or name."""
        return _session(self._resolve(ref))

    def _resolve(self, ref: str) -> SessionRow:
        """Full id, then exact name, then unique id prefix."""
        if not ref:
            raise InvalidArgument("empty session reference; give an id, an id prefix or a name (see `kvdb sessions`)")
        exact = self._store.get_session(ref)
        if exact is not None:
            return exact
        matches = self._store.match_sessions(ref)
        named = [m for m in matches if m.name == ref]
        matches = named or matches  # a name is meant exactly; an id prefix only when no name matches
        if not matches:
            raise SessionNotFound(f"no session matches {ref!r}; list them with `kvdb sessions`")
        if len(matches) > 1:
            listed = ", ".join(f"{m.session_id[:12]} ({m.name})" for m in matches[:5])
            raise AmbiguousSession(f"{ref!r} matches {len(matches)} sessions: {listed}; give more of the id")
        return matches[0]

    def tokens(self, session: str, start: int | None = None, end: int | None = None) -> np.ndarray:
        row = self._resolve(session)
        start, end = _clip_range(row, start, end)
        return self._path_tokens(row, start, end)

    def text(self, session: str, start: int | None = None, end: int | None = None) -> str:
        """The text of tokens [start, end). The whole of a text session is its original text, exactly."""
        row = self._resolve(session)
        start, end = _clip_range(row, start, end)
        if "text" in row.metadata and (start, end) == (0, row.n_tokens):
            return row.metadata["text"]
        tokenizer = self._tokenizer_for(row)
        return lm_ops.decode_tokens(tokenizer, self._path_tokens(row, start, end))

    def _tokenizer_for(self, row: SessionRow):
        """The archive's tokenizer, checked against the one the session was archived with."""
        if self._lm is not None:
            return self._checked_lm(row).tokenizer
        tokenizer, tok_hash = self._tokenizer_and_hash()
        archived = self._store.get_model(row.model_id)
        if archived is None or archived.tokenizer_hash != tok_hash:
            return self._checked_lm(row).tokenizer  # raises ModelMismatch unless the weights match after all
        return tokenizer

    def _checked_lm(self, row: SessionRow) -> LoadedModel:
        lm = self.lm
        if lm.identity.model_id != row.model_id:
            archived = self._store.get_model(row.model_id)
            was = archived.name if archived else row.model_id
            raise ModelMismatch(
                f"session {row.session_id[:12]} ({row.name}) was archived with model {was!r} "
                f"(id {row.model_id[:12]}), but this archive is open with {lm.identity.name!r} "
                f"(id {lm.identity.model_id[:12]}); pass --model {was!r}"
            )
        return lm

    def logprobs(self, session: str) -> np.ndarray:
        """Natural-log probability of each token under the archive's model, as computed at ingest
        (or, for a session held in tier L, computed again from its decoded tokens)."""
        row = self._resolve(session)
        path = self._store.node_path(row.session_id)
        if all("tokens" in n.keep for n in path):
            return self._store.load_logprobs(row.session_id)
        return lm_ops.score(self._checked_lm(row).model, self._path_tokens(row, path=path))[0]

    def prefix_bits(self, a: str, b: str) -> float:
        """d_T(a, b) = -log2 P_M(shared prefix): the information content of what the sessions
        share, a sum of the log-probabilities stored at ingest along their common trie path."""
        path_a = self._store.node_path(self._resolve(a).session_id)
        on_b = {n.node_id for n in self._store.node_path(self._resolve(b).session_id)}
        shared = [n for n in path_a if n.node_id in on_b]  # nodes two sessions share hold their log-probabilities
        return _bits(self._store.load_logprobs(shared[-1].node_id)) if shared else 0.0

    def prefixes(self, words: int = 8) -> list[Prefix]:
        """Every prefix two or more sessions share, with its length, bits and first words."""
        out = []
        for node in self._store.shared_nodes():
            logprobs = self._store.load_logprobs(node.node_id)
            head = self._store.load_tokens(node.node_id, 0, min(node.end, 4 * words))
            text = " ".join(self._text_of_tokens(node.model_id, head).split()[:words])
            out.append(Prefix(node.node_id, node.end, _bits(logprobs), node.refcount, text))
        return out

    def _text_of_tokens(self, model_id: str, ids: np.ndarray) -> str:
        row = self._store.get_model(model_id)
        tokenizer, tok_hash = self._tokenizer_and_hash()
        if row is not None and row.tokenizer_hash != tok_hash:
            return f"<{len(ids)} tokens of model {row.name}>"
        return lm_ops.decode_tokens(tokenizer, ids)

    # restore --------------------------------------------------------------------------
    def restore(self, session: str, at: int | None = None, mode: str = "auto") -> RestoredSession:
        """The model with a cache holding the session's first ``at`` tokens (default: all).

        ``exact`` prefills from the token tier; ``archive`` builds the cache from tier K (no
        forward pass over the session, approximate: see ``fidelity``); ``decode`` rebuilds tokens
        and cache from tier L alone, one model step per token; ``auto`` takes the archive when
        every node on the path has tier K, else the exact prefill.
        """
        if mode not in RESTORE_MODES:
            raise InvalidArgument(f"unknown restore mode {mode!r}; choose from {', '.join(RESTORE_MODES)}")
        row = self._resolve(session)
        at = row.n_tokens if at is None else at
        _clip_range(row, 0, at)
        lm = self._checked_lm(row)
        path = self._store.node_path(row.session_id)
        nodes = [n for n in path if n.start < at]
        if mode == "auto" and nodes and all("kv" in n.keep for n in nodes):
            mode = "archive"
        elif mode == "auto":  # where tier L is the only copy of some tokens, decoding it rebuilds the cache in the same pass
            mode = "exact" if all("tokens" in n.keep for n in nodes) else "decode"
        if mode == "decode" and nodes:
            return self._restore_decode(row, nodes, at)
        tokens = self._path_tokens(row, 0, at, path)
        if mode == "exact" or not nodes:  # nothing before position 0 to read from any tier
            self._store.release()  # the forward passes need nothing more from the file
            return restore_ops.restore_exact(lm, row.session_id, tokens)
        if mode == "archive":
            start = time.perf_counter()
            keys, values = self._kv_arrays(row, nodes, at)
            self._store.release()
            return restore_ops.restore_archive(lm, row.session_id, tokens, keys, values, start)
        raise AssertionError(f"unhandled restore mode {mode}")

    def _restore_decode(self, row: SessionRow, nodes, at: int) -> RestoredSession:
        """Decode tier L along the path; a node without it (a prefix shared with a session
        archived without tier L) is read from its tokens instead."""
        if not any("lm" in n.keep for n in nodes):
            raise InvalidArgument(
                f"session {row.session_id[:12]} ({row.name}) has no tier L on its first {at} tokens; "
                f"ingest it with --keep tokens,search,lm, or restore with --mode exact"
            )
        parts = [self._store.node_lm_payload(n.node_id) if "lm" in n.keep else self._store.node_tokens(n.node_id) for n in nodes]
        self._store.release()
        return restore_ops.restore_decode(self._checked_lm(row), row.session_id, parts, at)

    def _path_tokens(self, row: SessionRow, start: int = 0, end: int | None = None, path: list[NodeRow] | None = None) -> np.ndarray:
        """Tokens [start, end) of a session (``path``: its nodes, when read already): from the
        token blocks, or, where the path holds some only in tier L, from decoding it (one model
        step per token; kept for the next read)."""
        end = row.n_tokens if end is None else end
        path = self._store.node_path(row.session_id) if path is None else path
        if all("tokens" in n.keep for n in path if n.start < end):
            return self._store.path_tokens(path, start, end)
        if row.session_id not in self._decoded:
            self._decoded[row.session_id] = self._restore_decode(row, path, row.n_tokens).tokens
        return self._decoded[row.session_id][start:end]

    def _node_tokens(self, node: NodeRow, before: np.ndarray) -> np.ndarray:
        """A node's tokens, decoded from tier L given ``before`` (its path's tokens) when it holds no blocks."""
        if "tokens" in node.keep:
            return self._store.node_tokens(node.node_id)
        key = (node.node_id, node.start, node.n_tokens)
        if key not in self._decoded:
            context = self._lm_context(self.lm, before, len(before))
            self._decoded[key], _ = lmcode.decode(self.lm.model, self._store.node_lm_payload(node.node_id), context=context)
        return self._decoded[key]

    def _kv_arrays(self, row: SessionRow, nodes, at: int) -> tuple[np.ndarray, np.ndarray]:
        """De-quantized pre-RoPE keys and values of positions [0, at), node by node."""
        keys, values = [], []
        for node in nodes:
            stored = self._store.node_kv(node.node_id)
            if stored is None:
                raise InvalidArgument(
                    f"session {row.session_id[:12]} ({row.name}) has no tier K on all of its first {at} tokens; "
                    f"ingest it with --keep tokens,search,kv, or restore with --mode exact"
                )
            _, books = self._codebooks(node.model_id, stored[0])
            key_codes, value_codes = quant.codes_from_streams(books, stored[1], node.n_tokens)
            used = min(node.n_tokens, at - node.start)  # de-quantize only the positions restored
            k, v = quant.decode(books, (key_codes[..., :used], value_codes[..., :used]))
            keys.append(k)
            values.append(v)
        if len(keys) == 1:  # one node (the common case): no copy into a joined array
            return keys[0], values[0]
        return np.concatenate(keys, axis=2), np.concatenate(values, axis=2)

    def fidelity(self, session: str, at: int | None = None, probe: int = 32) -> dict:
        """How closely the archive restore follows the exact one: restore both ways ``probe``
        tokens before ``at`` and teacher-force the session's next tokens through each."""
        row = self._resolve(session)
        at = row.n_tokens if at is None else at
        _clip_range(row, 0, at)
        cut = max(capture.SINKS + 1, at - probe)
        if at - cut < 2:
            raise InvalidArgument(f"a fidelity probe needs at least {capture.SINKS + 3} tokens up to --at")
        archived = self.restore(row.session_id, at=cut, mode="archive")
        exact = self.restore(row.session_id, at=cut, mode="exact")
        return restore_ops.fidelity(self.lm, archived.cache, exact.cache, self._path_tokens(row, cut, at))

    def continue_session(self, session: str, prompt: str | None = None, max_new_tokens: int = 64, at: int | None = None) -> str:
        """Restore, append ``prompt`` (a new user turn for chat sessions), and continue greedily."""
        return self.generate(self.restore(session, at), prompt, max_new_tokens)

    def generate(self, restored: RestoredSession, prompt: str | None = None, max_new_tokens: int = 64) -> str:
        """Continue a restored session greedily; consumes ``restored.cache``."""
        chat = self._resolve(restored.session_id).metadata.get("kind") == "chat"
        prompt_ids = restore_ops.continuation_ids(self.lm, prompt, chat)
        return restore_ops.continue_restored(self.lm, restored, prompt_ids, max_new_tokens)

    # search ---------------------------------------------------------------------------
    def search(self, phrase: str, k: int = 10, context: int = 32, session: str | None = None) -> list[Hit]:
        """Where ``phrase`` occurs in the archived sessions: full matches first, then the
        positions sharing the longest suffix of it. Only the tokenizer is loaded."""
        if not phrase or not phrase.strip():
            raise InvalidArgument("empty search phrase; give some text to look for")
        tokenizer, tok_hash = self._tokenizer_and_hash()
        variants = phrase_variants(tokenizer, phrase)
        if max(len(v) for v in variants) > search_ops.MAX_PHRASE_TOKENS:
            raise InvalidArgument(
                f"phrase is {max(len(v) for v in variants)} tokens long; search takes at most {search_ops.MAX_PHRASE_TOKENS}"
            )
        key = index_key(tok_hash)
        slots, names, view = self._search_tables(key, tok_hash)
        if not len(slots.first):
            return []
        index = self._indexes.get(key, tok_hash)
        runs = dict(zip(slots.node_ids, slots.first.tolist()))
        sessions_of = lambda node_ids: {n: view.owner[n] for n in node_ids if n in view.owner}  # noqa: E731
        if session is not None:
            wanted = self._resolve(session).session_id
            on_path = {n.node_id for n in view.path(wanted)}
            keep = np.array([nid in on_path for nid in slots.node_ids], dtype=bool)
            slots = SlotMap(slots.node_ids[keep], slots.first[keep], slots.length[keep], slots.start[keep])
            sessions_of = lambda node_ids: dict.fromkeys(node_ids, wanted)  # noqa: E731  (hits are reported in this session)
        return search_ops.search(
            index,
            slots,
            variants,
            names,
            sessions_of=sessions_of,
            fetch=lambda requests: view.windows(self._store, requests, runs, index.tokens),
            decode=lambda ids: lm_ops.decode_tokens(tokenizer, ids),
            k=k,
            context=context,
        )

    def search_semantic(self, phrase: str, k: int = 10, context: int = 32, layer: int | None = None) -> list[Hit]:
        """Archived positions whose keys in ``layer`` (default: the middle one) are nearest the
        phrase's last key: contexts the model represents alike, whatever their words. Covers the
        sessions stored with tier K; loads the model (the phrase is run through it)."""
        if not phrase or not phrase.strip():
            raise InvalidArgument("empty search phrase; give some text to look for")
        lm = self.lm
        layers = lm.model.config.num_hidden_layers
        layer = layers // 2 if layer is None else layer
        if not 0 <= layer < layers:
            raise InvalidArgument(f"layer must be from 0 to {layers - 1}, got {layer}")
        ids = np.asarray(lm_ops.encode_text(lm.tokenizer, phrase), dtype=np.int64)
        nodes, offsets, vectors = self._semantic_table(lm.identity.model_id, layer)
        if not len(nodes):
            return []
        names, view = self._trie_view()
        hits = []
        rows, scores = semantic_ops.nearest(vectors, semantic_ops.query_vector(lm.model, ids, layer), 4 * k)
        for row, score in zip(rows, scores):
            node = view.nodes[nodes[row]]
            session_id = view.owner.get(node.node_id)
            if session_id is None:
                continue
            position = node.start + int(offsets[row])
            lo, hi = max(0, position - context), position + 1 + context
            window = self._store.load_tokens(session_id, lo, min(hi, view.path(session_id)[-1].end))
            decode = lambda a, b: lm_ops.decode_tokens(lm.tokenizer, window[a - lo : b - lo])  # noqa: E731
            hits.append(
                Hit(session_id, names.get(session_id, ""), position, 1, len(ids), False,
                    decode(lo, position), decode(position, position + 1), decode(position + 1, hi), float(score))
            )
            if len(hits) == k:
                break
        return hits

    def _semantic_table(self, model_id: str, layer: int):
        """(node ids, offsets, unit key vectors) of every position stored with tier K, cached."""
        cache_key = f"semantic:{model_id}:{layer}"
        if cache_key not in self._search_cache:
            nodes, offsets, vectors = [], [], []
            for node in self._store.nodes_of([model_id]):
                stored = self._store.node_kv(node.node_id) if node.refcount > 0 and "kv" in node.keep else None
                if stored is None:
                    continue
                _, books = self._codebooks(model_id, stored[0])
                vectors.append(semantic_ops.position_vectors(books, stored[1], node.n_tokens, layer))
                nodes += [node.node_id] * node.n_tokens
                offsets.append(np.arange(node.n_tokens))
            self._search_cache[cache_key] = (
                np.array(nodes, dtype=object),
                np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
                np.concatenate(vectors) if vectors else np.zeros((0, 1), np.float32),
            )
        return self._search_cache[cache_key]

    def _search_tables(self, key: str, tok_hash: str) -> tuple[SlotMap, dict[str, str], trie.TrieView]:
        """Slot runs of the live nodes, session names and the trie's shape, cached until the archive changes."""
        self._drop_stale_cache()
        if key not in self._search_cache:
            self._indexes.get(key, tok_hash)  # rebuilds the index (and its runs) when stale
            self._search_cache[key] = SlotMap.from_rows(self._store.slot_runs(key))
        return (self._search_cache[key], *self._trie_view())

    def _trie_view(self) -> tuple[dict[str, str], trie.TrieView]:
        """Session names and the trie's shape, read once until the archive changes."""
        self._drop_stale_cache()
        if "trie" not in self._search_cache:
            self._search_cache["trie"] = ({s.session_id: s.name for s in self._store.list_sessions()}, trie.TrieView.load(self._store))
        return self._search_cache["trie"]

    def _drop_stale_cache(self) -> None:
        """Another process can write only while this one has let the file go: after that, reread."""
        if self._search_epoch != self._store.connections:
            self._changed()
            self._search_epoch = self._store.connections

    def _changed(self) -> None:
        """Forget what was derived from the tables: the next search reads them again."""
        self._search_cache.clear()

    def rebuild_index(self) -> dict:
        """Rebuild the search index of the archive's tokenizer from the token streams."""
        _, tok_hash = self._tokenizer_and_hash()
        key = index_key(tok_hash)
        start = time.perf_counter()
        self._changed()
        index = self._indexes.rebuild(key, tok_hash)
        return {
            "index_key": key,
            "sessions": len(self._store.list_sessions()),
            "nodes": len(self._store.slot_runs(key)),
            "points": index.ntotal,
            "seconds": round(time.perf_counter() - start, 3),
        }

    def _tokenizer_and_hash(self):
        """(tokenizer, its hash): the loaded model's, else the tokenizer alone (hashing it once)."""
        if self._lm is not None:
            return self._lm.tokenizer, self._lm.identity.tokenizer_hash
        if self._tokenizer is None:
            tokenizer = lm_ops.load_tokenizer(self.model_name)
            self._tokenizer = (tokenizer, lm_ops.tokenizer_hash(tokenizer))
        return self._tokenizer

    # maintenance ----------------------------------------------------------------------
    def delete(self, session: str) -> Session:
        """Remove a session. Prefix nodes other sessions share stay; `gc` frees the rest."""
        row = self._resolve(session)
        self._changed()
        self._store.delete_session(row.session_id)
        return _session(row)

    def compact(self, session: str, keep: str | Iterable[str]) -> Session:
        """Drop the tiers not in ``keep`` from every node of the session's path (shared prefix
        nodes included: they are one stored object for all the sessions that share them).

        The token tier is the exception: only the nodes no other session uses drop it, and only
        where tier L holds their tokens, since every session sharing a node reads and matches
        through its tokens. Keeping ``tokens`` on a session held in tier L decodes them back.
        """
        keep = parse_keep(keep)
        row = self._resolve(session)
        path = self._store.node_path(row.session_id)
        drops = {n.node_id: set(TIERS) - keep - {"tokens"} for n in path}
        if "tokens" not in keep:
            for node in path:
                if node.refcount == 1:
                    drops[node.node_id].add("tokens")
                    if "lm" not in node.keep:
                        raise InvalidArgument(
                            f"session {row.session_id[:12]} ({row.name}) has no tier L on tokens [{node.start}, {node.end}): "
                            "dropping the token tier would lose them; re-ingest it with --keep tokens,search,lm first"
                        )
        restored = {}
        if "tokens" in keep and any("tokens" not in n.keep for n in path):
            ids = self._path_tokens(row)
            logprobs = lm_ops.score(self._checked_lm(row).model, ids)[0]
            restored = {n.node_id: (ids[n.start : n.end], logprobs[n.start : n.end]) for n in path if "tokens" not in n.keep}
        self._changed()
        self._store.drop_tiers(drops, restored)
        return _session(row)

    def verify(self, deep: bool = False) -> verify_ops.Report:
        """Check stored blocks (a sample of each tier, or all with ``deep``), the trie, reference
        counts and the search indexes; ``deep`` also decodes every session and checks its hash.

        A search index behind or ahead of the database (a crash between writing the two) is
        what opening the index detects and rebuilds anyway; verify does that first and notes it.
        """
        before = len(self._indexes.rebuilt)
        for tok_hash in self._store.tokenizer_hashes():
            self._indexes.get(index_key(tok_hash), tok_hash)
        notes = [f"search index {key} was missing or disagreed with the database; rebuilt" for key in self._indexes.rebuilt[before:]]
        return verify_ops.verify(self._store, {key: self._indexes.path(key) for key in self._store.index_keys()}, deep, notes)

    def repair(self) -> dict:
        """Rebuild what can be derived (the search indexes); report what cannot."""
        self._changed()
        rebuilt = []
        for tok_hash in self._store.tokenizer_hashes():
            self._indexes.rebuild(index_key(tok_hash), tok_hash)
            rebuilt.append(index_key(tok_hash))
        remaining = self.verify(deep=True).problems
        return {"rebuilt_indexes": rebuilt, "unrepairable": remaining, "ok": not remaining}

    def gc(self) -> dict:
        """Free the trie nodes (and every tier stored for them) that no session uses any more,
        and the prefix-cache entries of the conversations they held (a deleted session's KV
        must not outlive it on disk)."""
        self._changed()
        freed = self._store.gc()
        freed["prefix_cache_entries"] = self._prefix_cache.prune({n.node_id for n, _, _ in self._store.node_shapes()})
        return freed

    def stats(self) -> Stats:
        counts = self._store.byte_counts()
        tiers = {
            "tokens": counts["token_bytes"],
            "lm": counts["lm_bytes"],
            "kv": counts["kv_bytes"],
            "logprobs": counts["logprob_bytes"],
            "metadata": counts["metadata_bytes"],
        }
        n = counts["tokens"]
        per_token = {k: (v / n if n else 0.0) for k, v in tiers.items()}
        # tier K is optional per node: its bytes are spread over the tokens stored with it
        per_token["kv"] = counts["kv_bytes"] / counts["kv_tokens"] if counts["kv_tokens"] else 0.0
        file_bytes = self.path.stat().st_size if self.path.exists() else 0
        fp16 = self._fp16_bytes_per_token()
        ratio = fp16 / per_token["kv"] if per_token["kv"] and fp16 else None
        return Stats(
            counts["sessions"], n, counts["stored_tokens"], counts["nodes"],
            dict(tiers, file=file_bytes, codebooks=counts["codebook_bytes"], prefix_cache=self._prefix_cache.size()),
            per_token, ratio, counts["codebook_bytes"],
        )

    def _fp16_bytes_per_token(self) -> int | None:
        """K and V of one token in fp16 for the archive's first model: 2 x layers x kv heads x head dim x 2 B."""
        for row in self._store.list_sessions()[:1]:
            c = self._store.get_model(row.model_id).config
            if c.get("num_hidden_layers") and c.get("num_key_value_heads"):
                head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
                return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2
        return None


def parse_keep(keep: str | Iterable[str]) -> frozenset[str]:
    """The tiers of a --keep list. The tokens must survive in one of two forms: their blocks
    (``tokens``) or tier L (``lm``); the search tier is built from, and copies, the tokens."""
    tiers = {t.strip() for t in (keep.split(",") if isinstance(keep, str) else keep) if t.strip()}
    unknown = tiers - set(TIERS)
    if unknown:
        raise InvalidArgument(f"unknown tier(s) {', '.join(sorted(unknown))}; choose from {', '.join(TIERS)}")
    if not tiers & {"tokens", "lm"}:
        raise InvalidArgument("keep `tokens` or `lm` (the tokens coded against the model): without either the session is lost")
    if "search" in tiers and "tokens" not in tiers:
        raise InvalidArgument("the search tier needs the token tier (its index is built from the tokens, and holds a copy of them)")
    return frozenset(tiers)


def _match_key(match: trie.PrefixMatch) -> tuple:
    """What a session's write depends on in a prefix match (not, say, the node's refcount)."""
    node = match.node
    return match.matched, match.offset, None if node is None else (node.node_id, node.start, node.n_tokens, node.keep)


def _bits(logprobs: np.ndarray) -> float:
    return float(-np.sum(logprobs, dtype=np.float64) / np.log(2))


def index_key(tokenizer_hash: str) -> str:
    """One search index per tokenizer: token ids mean the same thing only under one tokenizer."""
    return tokenizer_hash[:16]


def phrase_variants(tokenizer, phrase: str) -> list[np.ndarray]:
    """The token sequences a phrase can have inside text: as typed, and after a space."""
    variants = []
    for text in (phrase, " " + phrase if not phrase.startswith(" ") else None):
        if text is not None:
            ids = np.asarray(lm_ops.encode_text(tokenizer, text), dtype=np.int64)
            if len(ids) and not any(np.array_equal(ids, v) for v in variants):
                variants.append(ids)
    return variants


def _session(row: SessionRow) -> Session:
    return Session(row.session_id, row.name, row.source, row.n_tokens, row.created_at, row.model_id, row.metadata)


def _clip_range(row: SessionRow, start: int | None, end: int | None) -> tuple[int, int]:
    start = 0 if start is None else start
    end = row.n_tokens if end is None else end
    if not 0 <= start <= end <= row.n_tokens:
        raise InvalidArgument(
            f"range [{start}, {end}) is outside session {row.session_id[:12]} ({row.name}), which has {row.n_tokens} tokens"
        )
    return start, end


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
