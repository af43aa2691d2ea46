"""A model as the write path knows it without its weights: its identity, tokenizer, context
length and vocabulary size.

Archiving the token tiers runs no model (issue 53): a session is named by the model's id, cut
into parts by its context and coded over its vocabulary, all facts of its files. Hashing the
weights to learn the id costs a load (seconds; the embedded model's first, tens), so the facts are
kept in the user cache per model folder, keyed by its files' sizes and mtimes, and written
whenever the model loads (``remember``); a model never loaded on this machine is loaded once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvdb.model import tokenizer as tok
from kvdb.model.source import DEFAULT_MODEL, embedded_folder, model_name, require_local
from kvdb.storage.base import ModelRow
from kvdb.user_cache import read_cached, stamp_key, write_cached

FACTS = "model-facts"  # cache_dir() subfolder: a model folder's identity, context and vocabulary
DEFAULT_CONTEXT_TOKENS = 8192  # for a model config that does not say


@dataclass(frozen=True)
class Described:
    """What ingest needs of a model; ``LoadedModel`` has the same attributes, and the weights."""

    tokenizer: Any  # transformers' tokenizer: chat templates render only there
    identity: ModelRow
    context_tokens: int
    vocab_size: int


def describe(name: str | None = None) -> Described | None:
    """The model's facts from the user cache; None where this machine has not loaded it (loading
    it caches them)."""
    name = model_name(name)
    require_local(name)
    folder = _folder(name)
    cached = read_cached(FACTS, stamp_key(folder)) if folder is not None else None
    if cached is None:
        return None
    facts = json.loads(cached)
    identity = ModelRow(**dict(facts["identity"], name=name))
    return Described(tok.load_full(name), identity, int(facts["context_tokens"]), int(facts["vocab_size"]))


def kept(name: str) -> bool:
    """Whether a load of the model caches its facts: the embedded model (converted on its first
    load) and a local folder, not a Hugging Face id."""
    return name == DEFAULT_MODEL or _folder(name) is not None


def remember(name: str, identity: ModelRow, config) -> None:
    """Cache what ``describe`` reads, from a loaded model's transformers ``config``."""
    folder = _folder(name)
    if folder is None:
        return
    facts = {
        "identity": asdict(identity),
        "context_tokens": context_tokens(config),
        "vocab_size": int(config.vocab_size),
    }
    write_cached(FACTS, stamp_key(folder), json.dumps(facts, sort_keys=True))


def context_tokens(config) -> int:
    return int(getattr(config, "max_position_embeddings", None) or DEFAULT_CONTEXT_TOKENS)


def _folder(name: str) -> Path | None:
    """The model's files: the embedded model's converted copy (once written), or a local folder;
    None for a Hugging Face id (its cache's files are not stamped here)."""
    folder = embedded_folder() if name == DEFAULT_MODEL else Path(name)
    return folder if (folder / "config.json").is_file() else None
