"""A model's tokenizer without torch or transformers, for the commands that only read.

``kvdb show``, ``search`` and ``sessions`` only turn token ids into text and a phrase into ids.
transformers takes seconds to import (``AutoTokenizer`` more, and torch with it); the
`tokenizers` library it wraps, a fiftieth of that. For a model folder whose ``tokenizer_config.json``
names the generic fast tokenizer (``TokenizersBackend``; v4 wrote ``PreTrainedTokenizerFast``),
transformers' tokenizer is that library's ``Tokenizer`` read from ``tokenizer.json``, plus the
chat template and the config's ``split_special_tokens``; :func:`load` builds exactly that, as a
:class:`LightTokenizer`, and :func:`encode` / :func:`decode` call it as transformers does
(no special tokens added, no truncation or padding, no clean-up of spaces).

Archives record :func:`fingerprint` (the ``tokenizer_hash``: sha256 of the serialized backend,
NUL, the chat template), so the light tokenizer must give transformers' fingerprint exactly.
Loading, transformers may change the backend: it adds special tokens the config names and
``tokenizer.json`` lacks, marks the ones it has as special, builds a post-processor where there
is none, and patches the pre-tokenizer of large Mistral vocabularies. A folder transformers
saved is a fixed point of those changes; another need not be. So the light tokenizer is used
only when its fingerprint equals the one transformers gave for the same files: that one is
cached under ``cache_dir()/tokenizer-hashes``, keyed by the folder's file sizes and mtimes and
the library versions, and written whenever transformers loads the tokenizer (:func:`load_full`,
which ``model.load()`` calls). The light tokenizer's own is cached beside it under the same
key. Otherwise, and for other tokenizer classes, Hub ids or an embedded model not yet converted,
:func:`load` returns transformers' tokenizer.

A light tokenizer does not render chat templates: ingest and generation load the model, and
with it :func:`load_full`'s tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvdb.model.source import (
    DEFAULT_MODEL,
    embedded_folder,
    hub_offline,
    in_own_process,
    loading,
    model_folder,
    model_name,
    require_local,
)
from kvdb.recent import Recent
from kvdb.user_cache import read_cached, stamp_key, write_cached

if TYPE_CHECKING:
    from tokenizers import Tokenizer

GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")
# the role word a template writes after a turn's opening token
ROLE_HEADER = r"^(system|user|assistant|tool|model|developer)\n"
# tokenizer -> which ids are special tokens (see snippet_texts)
_SPECIAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
FINGERPRINTS = "tokenizer-hashes"  # cache_dir() subfolder: transformers' fingerprint per folder stamp
# cache_dir() subfolder: the light tokenizer's fingerprint per folder stamp (serializing the backend
# to hash it took 20 ms of every process that reads tokens)
LIGHT_FINGERPRINTS = "tokenizer-light-hashes"
PIECE_CHARS = 1 << 16  # a text longer than this is encoded in pieces of about this many characters (see encode)
# the pieces whose ids each tokenizer remembers, the latest used (see encode): a log of ~1M tokens, ~10 MB
KNOWN_PIECES = 64
_KNOWN = Recent(KNOWN_PIECES)  # tokenizer -> {piece: its ids}


@dataclass(frozen=True, eq=False)
class LightTokenizer:
    """A model's tokenizer for encoding and decoding only. It has none of a transformers
    tokenizer's methods, so it cannot be taken for one: use the functions of this module."""

    name: str
    backend: Tokenizer = field(repr=False)  # truncation and padding off
    chat_template: str | dict | None = field(repr=False)  # part of the fingerprint; never rendered here
    fingerprint: str


def load(name: str | None = None):
    """The tokenizer alone, light where it gives transformers' fingerprint (see the module docstring),
    else transformers' own."""
    name = model_name(name)
    require_local(name)
    folder = embedded_folder() if name == DEFAULT_MODEL else Path(name)
    key = _fingerprint_key(folder) if folder.is_dir() else None  # both fingerprints are cached under it
    expected = read_cached(FINGERPRINTS, key) if key else None
    if name == DEFAULT_MODEL and expected is None:
        # The first use converts the GGUF and asks transformers for the fingerprint in a process
        # of its own: in this one, the de-quantized weights and transformers stayed resident to
        # the end of a first ingest, which needs only the tokenizer (decision 0070)
        in_own_process("kvdb.model.tokenizer:load_full", name)
        key = _fingerprint_key(folder)  # the conversion wrote the folder's files
        expected = read_cached(FINGERPRINTS, key)
    light = _light(name, folder, key) if key else None
    if light is None:
        return load_full(name)
    if expected is None:  # first read of these files: transformers says what the fingerprint is (and caches it)
        full = load_full(name)
        expected = fingerprint(full)
        if expected != light.fingerprint:
            return full
    return light if expected == light.fingerprint else load_full(name)


def load_full(name: str | None = None):
    """transformers' tokenizer (what ``model.load()`` returns; it renders chat templates).

    AutoTokenizer imports transformers' whole model registry (and torch); a folder whose
    config names the generic fast tokenizer is loaded by that class directly, which is the object
    AutoTokenizer would build (same class, same files, same fingerprint).
    """
    name = model_name(name)
    require_local(name)
    folder: str | Path = name
    if name == DEFAULT_MODEL:
        folder = embedded_folder()
        if not (folder / "config.json").is_file():
            # the first use converts the embedded GGUF (torch; benchmarks/RESULTS.md, "Ingest throughput and
            # model load")
            folder = model_folder(name)
    with loading(name):
        if _tokenizer_class(folder) in GENERIC_FAST:
            from transformers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(folder, local_files_only=hub_offline())
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=hub_offline())
    if Path(folder).is_dir() and _cached_fingerprint(Path(folder)) is None:
        write_cached(FINGERPRINTS, _fingerprint_key(Path(folder)), fingerprint(tokenizer))
    return tokenizer


def fingerprint(tokenizer) -> str:
    """The ``tokenizer_hash`` an archive records: sha256 of the serialized tokenizer, NUL, the chat template."""
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.fingerprint
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return _digest(vocab, getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as it stands, with no special tokens added.

    A long text (a whole agent log rendered: tens of MB) is encoded in pieces, in one batch on
    every core: the fast tokenizer takes one text on one thread, and its time and memory grow
    faster than the text (decision 0053 measured a whole Claude Code log).
    The pieces are cut where a special token begins, which is where the tokenizer cuts the text
    itself before anything else sees it (its added tokens are matched first), so the ids are
    the same as whole.

    The pieces but the last are remembered (``KNOWN_PIECES`` of them), and not encoded again: the
    cuts depend only on the text before them, so a log that grows (a watched one, rendered again
    whole at each new turn) keeps its pieces but the last, and only that one and what follows
    are encoded again."""
    pieces = _pieces(tokenizer, text)
    if len(pieces) > 1:
        encoded: list = _KNOWN.get(tokenizer, pieces)
        todo = [k for k, ids in enumerate(encoded) if ids is None]
        if todo:
            batch = [pieces[k] for k in todo]
            if isinstance(tokenizer, LightTokenizer):
                fresh = [e.ids for e in tokenizer.backend.encode_batch(batch, add_special_tokens=False)]
            else:
                fresh = tokenizer(batch, add_special_tokens=False)["input_ids"]
            for k, ids in zip(todo, fresh):
                encoded[k] = ids
        # the last piece is the one a growing text changes
        _KNOWN.put(tokenizer, [(piece, array("i", ids)) for piece, ids in zip(pieces[:-1], encoded)])
        return [i for ids in encoded for i in ids]
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each of ``texts`` (short ones: a search's words in their casings), in one
    batch, as :func:`encode` gives each."""
    if not texts:
        return []
    if isinstance(tokenizer, LightTokenizer):
        return [e.ids for e in tokenizer.backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _pieces(tokenizer, text: str) -> list[str]:
    """``text`` cut, about every ``PIECE_CHARS``, where a special token begins (the whole text where
    it is short, has none, or the tokenizer reads special tokens as plain text)."""
    if len(text) <= PIECE_CHARS:
        return [text]
    backend = (
        tokenizer.backend if isinstance(tokenizer, LightTokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    )
    if backend is None or backend.encode_special_tokens:
        return [text]
    specials = [
        t.content for t in backend.get_added_tokens_decoder().values() if t.special and not t.normalized and t.content
    ]
    if not specials:
        return [text]
    found = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
    cuts, last = [0], 0
    for match in found.finditer(text):
        if match.start() - last >= PIECE_CHARS:
            cuts.append(match.start())
            last = match.start()
    return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]


def _id_list(ids) -> list[int]:
    """``ids`` as the list of Python ints a tokenizer decodes: an array's in one call."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(map(int, ids))


def decode(tokenizer, ids) -> str:
    """The text of ``ids``, special tokens included, spaces left as they are."""
    ids = _id_list(ids)
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def plain_text(tokenizer, ids) -> str:
    """The text of ``ids`` without special tokens (a chat template's turn markers): what a
    sentence-embedding model or a reader of a snippet is given."""
    ids = _id_list(ids)
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.backend.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def snippet_texts(tokenizer, pieces: Sequence[np.ndarray]) -> list[str]:
    """The text of each piece of ids as a reader of a snippet wants it: without special tokens,
    and without the role word a chat template writes after the special token that opens a turn
    (``<|im_start|>assistant\\n``). Found from the token ids, so that the light tokenizer, which
    renders no template, finds it too. Which pieces hold special tokens is asked of all of them
    at once: a search decodes tens of short pieces, most with none."""
    pieces = [np.asarray(ids, dtype=np.int64) for ids in pieces]
    special = _special_mask(tokenizer)

    def marked(ids: np.ndarray) -> np.ndarray:
        return special[np.minimum(ids, len(special) - 1)] & (ids < len(special))

    lengths = np.array([len(ids) for ids in pieces], np.int64)
    seen = np.concatenate([[0], np.cumsum(marked(np.concatenate([np.zeros(0, np.int64), *pieces])))])
    ends = np.cumsum(lengths)
    out = []
    for ids, count in zip(pieces, (seen[ends] - seen[ends - lengths]).tolist()):
        if not count:
            out.append(decode(tokenizer, ids))
            continue
        bounds = [-1, *np.flatnonzero(marked(ids)).tolist(), len(ids)]
        turns = [decode(tokenizer, ids[bounds[k] + 1 : bounds[k + 1]]) for k in range(len(bounds) - 1)]
        out.append("".join(re.sub(ROLE_HEADER, "", text, count=1) if k else text for k, text in enumerate(turns)))
    return out


def snippet_text(tokenizer, ids) -> str:
    """``snippet_texts`` of one piece."""
    return snippet_texts(tokenizer, [ids])[0]


def _special_mask(tokenizer) -> np.ndarray:
    """Whether each id up to the largest special token's is a special token."""
    if tokenizer not in _SPECIAL:
        added = (
            tokenizer.backend.get_added_tokens_decoder()
            if isinstance(tokenizer, LightTokenizer)
            else tokenizer.added_tokens_decoder
        )
        ids = [i for i, token in added.items() if token.special]
        mask = np.zeros(max(ids, default=0) + 1, dtype=bool)
        mask[ids] = True
        _SPECIAL[tokenizer] = mask
    return _SPECIAL[tokenizer]


# the light tokenizer --------------------------------------------------------------------------


def _light(name: str, folder: Path, key: str) -> LightTokenizer | None:
    """The folder's tokenizer as transformers' generic fast class builds it, or None if it is not
    one; ``key``: the folder's fingerprint key (``_fingerprint_key``)."""
    config = _tokenizer_config(folder)
    if config.get("tokenizer_class") not in GENERIC_FAST or "fast_tokenizer_files" in config:
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - missing or unreadable: transformers' load says what is wrong
        return None
    template = _chat_template(folder, config)
    digest = read_cached(LIGHT_FINGERPRINTS, key)  # the same files and library versions serialize the same
    if digest is None:
        digest = _digest(backend.to_str(), template)
        with contextlib.suppress(OSError):  # a cache that cannot be written costs the next process 20 ms
            write_cached(LIGHT_FINGERPRINTS, key, digest)
    # What transformers does to the backend after hashing, on each call: split_special_tokens is
    # set at load and checked per call; truncation and padding are switched off for one text.
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    backend.no_truncation()
    backend.no_padding()
    return LightTokenizer(name, backend, template, digest)


def _chat_template(folder: Path, config: dict):
    """The template as transformers 5 loads it: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``
    (a dict when there are several), else the config's ``chat_template`` (a list of named ones becomes a dict)."""
    templates = {}
    default = folder / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    for path in _extra_templates(folder):
        templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    if templates:
        return templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def _extra_templates(folder: Path) -> list[Path]:
    extra = folder / "additional_chat_templates"
    return list(extra.glob("*.jinja")) if extra.is_dir() else []


def _digest(vocab: str, template) -> str:
    return hashlib.sha256(f"{vocab}\0{template or ''}".encode()).hexdigest()


def _cached_fingerprint(folder: Path) -> str | None:
    return read_cached(FINGERPRINTS, _fingerprint_key(folder))


def _fingerprint_key(folder: Path) -> str:
    import tokenizers

    templates = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in _extra_templates(folder))
    return stamp_key(folder, _version("transformers"), tokenizers.__version__, templates)


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _tokenizer_class(folder: str | Path) -> str | None:
    return _tokenizer_config(folder).get("tokenizer_class")


def _tokenizer_config(folder: str | Path) -> dict:
    try:
        config = json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
