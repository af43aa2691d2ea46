"""The archive's model: loaded on first use (seconds; a first conversion, tens), registered
before the first write that uses it, and checked against the model each session was archived with.
Commands that only show text load the tokenizer alone, which imports neither torch nor
transformers."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvdb.errors import ModelMismatch
from kvdb.model import description, identity, source
from kvdb.model import tokenizer as tok
from kvdb.storage import Storage
from kvdb.storage.base import PutModel, SessionRow


class ModelProvider:
    def __init__(self, storage: Storage, model=None):
        """``model``: a name (Hugging Face id or folder; default: ``$KVDB_MODEL``, else the
        embedded model), or a model loaded already (``kvdb.model.loading.LoadedModel``) to share."""
        self._storage = storage
        named = model is None or isinstance(model, (str, os.PathLike))
        self._loaded = None if named else model
        self.name = source.model_name(str(model) if model else None) if named else model.identity.name
        self._tokenizer: tuple[Any, str] | None = None  # (tokenizer, hash) when only the tokenizer was needed
        self._full_tokenizer = None  # transformers' tokenizer without the model, once a chat template had to be read
        self._placed = False  # whether the model's identity in this archive was looked up
        self._registered = False
        self._described: description.Described | None = None  # while the weights are not needed

    @property
    def loaded(self):
        """The model if it is loaded already, else None."""
        return self._loaded

    def get(self):
        """The model, loaded on first use, as this archive knows it (an archive of kvdb 0.1.0 keeps
        its model ids: kvdb.model.identity). A read: ``register`` records it."""
        if self._loaded is None:
            source.require_local(self.name)  # a name that is not here fails without importing torch
            from kvdb.model import loading as lm_ops

            self._storage.before_compute()  # loading takes seconds: nobody waits on the file meanwhile
            self._loaded = lm_ops.load(self.name)
        if not self._placed:
            here = identity.in_archive(self._storage, self._loaded.identity)
            if here != self._loaded.identity:  # a view for this archive: a shared model keeps its own identity
                self._loaded = dataclasses.replace(self._loaded, identity=here)
            self._placed = True
        return self._loaded

    def register(self) -> None:
        """Record the model in the archive: the write path does, before its first write that uses it."""
        loaded = self.described()
        if not self._registered:
            self._storage.apply(PutModel(loaded.identity))
            self._registered = True

    def tokenizer(self):
        """(tokenizer, its hash): the loaded model's, else the tokenizer alone (hashed once)."""
        if self._loaded is not None:
            return self._loaded.tokenizer, self._loaded.identity.tokenizer_hash
        if self._tokenizer is None:
            loaded = tok.load(self.name)
            self._tokenizer = (loaded, tok.fingerprint(loaded))
        return self._tokenizer

    def for_session(self, row: SessionRow):
        """The model, refused (with what to pass instead) unless it is the one the session was archived with."""
        loaded = self.get()
        if loaded.identity.model_id != row.model_id:
            archived = self._storage.get_model(row.model_id)
            was = archived.name if archived else row.model_id
            raise ModelMismatch(
                f"session {row.session_id[:12]} ({row.name}) was archived with model {was!r} "
                f"(id {row.model_id[:12]}), but this archive is open with {loaded.identity.name!r} "
                f"(id {loaded.identity.model_id[:12]}); pass --model {was!r}"
            )
        return loaded

    def tokenizer_for(self, row: SessionRow):
        """The archive's tokenizer, checked against the one the session was archived with."""
        if self._loaded is not None:
            return self.for_session(row).tokenizer
        tokenizer, tok_hash = self.tokenizer()
        archived = self._storage.get_model(row.model_id)
        if archived is None or archived.tokenizer_hash != tok_hash:
            return self.for_session(row).tokenizer  # raises ModelMismatch unless the weights match after all
        return tokenizer

    def chat_tokenizer_for(self, row: SessionRow):
        """``tokenizer_for``, as transformers' tokenizer: a chat template renders only there."""
        tokenizer = self.tokenizer_for(row)
        if not isinstance(tokenizer, tok.LightTokenizer):
            return tokenizer
        if self._full_tokenizer is None:
            self._full_tokenizer = tok.load_full(self.name)
        return self._full_tokenizer

    def text_of_tokens(self, model_id: str, ids) -> str:
        """Text of another model's tokens only when it shares this tokenizer; else a placeholder."""
        row = self._storage.get_model(model_id)
        tokenizer, tok_hash = self.tokenizer()
        if row is not None and row.tokenizer_hash != tok_hash:
            return f"<{len(ids)} tokens of model {row.name}>"
        return tok.decode(tokenizer, ids)

    def described(self):
        """The model's facts without its weights (``kvdb.model.description``): the loaded model
        where it is loaded already; what the token tiers' write path runs on."""
        if self._loaded is not None:
            return self.get()
        if self._described is None:
            described = description.describe(self.name)
            if described is None and description.kept(self.name):  # never loaded on this machine
                self._storage.before_compute()
                # a load caches the facts: in a process of its own, whose weights go back to the
                # system with it; in this one they stayed resident to the end of a first ingest
                # (decision 0070)
                source.in_own_process("kvdb.model.loading:load", self.name)
                described = description.describe(self.name)
            if described is None:  # a Hugging Face id: its facts are not kept, so it loads here
                return self.get()
            self._described = dataclasses.replace(
                described, identity=identity.in_archive(self._storage, described.identity)
            )
        return self._described
