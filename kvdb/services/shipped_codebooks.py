"""Tier K codebooks that need no training: built once per machine from the calibration text
shipped in the package (``kvdb/data/calibration.txt``, provenance in ``kvdb/data/README.md``)
and cached beside the converted model, so ``--keep kv`` works on a fresh archive.

An archive never stores these centroids (18.2 MB for SmolLM2's default preset, about 0.8 times
the fp16 cache of a 1,000-token session). It stores a *reference* (:class:`Reference`, a few hundred bytes):
the recipe that builds them (model weights and tokenizer, the calibration text's hash, preset,
sizes, trainer settings) and the hash of the bytes the writing machine built. Another machine
builds the same recipe; its floating point may differ in the last bits (the model's forward
pass), so its centroids may differ by rounding, which moves a restore's values by as much and
never makes a code mean another centroid: the content hash is kept to tell the two apart, not
to refuse.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdb.codecs import code_layout, presets, transform
from kvdb.codecs.code_layout import KVCodebooks
from kvdb.codecs.quant import KINDS
from kvdb.errors import CorruptData
from kvdb.files import replace_whole
from kvdb.model import tokenizer as tok
from kvdb.records import CodebookSet, CodebookSource
from kvdb.storage.base import CodebookRow
from kvdb.user_cache import cache_dir

CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"  # kvdb/data/
RECIPE_VERSION = 1
CHUNK = 2048  # calibration contexts: long enough to hold states far from the sinks
POSITIONS = 8192  # vectors per codebook, as `kvdb codebooks train` defaults to
NITER = 12

MAGIC = b"KVDBRVQR"
VERSION = 1
_PREFIX = struct.Struct("<8s I I")  # magic, version, JSON length
_CRC = struct.Struct("<I")


def is_reference(blob: bytes) -> bool:
    return bytes(blob[:8]) == MAGIC


@dataclass(frozen=True)
class Reference:
    """What an archive stores in place of shipped codebooks."""

    recipe: dict
    content_sha256: str  # of the codebook bytes the writing machine built
    nbytes: int  # their size

    @property
    def key(self) -> str:
        return recipe_key(self.recipe)

    def to_bytes(self) -> bytes:
        """``MAGIC | u32 version | u32 JSON length | JSON | u32 CRC32`` (docs/formats.md)."""
        body = json.dumps(
            {"recipe": self.recipe, "content_sha256": self.content_sha256, "bytes": self.nbytes},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        head = _PREFIX.pack(MAGIC, VERSION, len(body)) + body
        return head + _CRC.pack(zlib.crc32(head))

    @classmethod
    def from_bytes(cls, blob: bytes) -> Reference:
        blob = bytes(blob)
        if len(blob) < _PREFIX.size + _CRC.size or not is_reference(blob):
            raise CorruptData("not a kvdb shipped-codebook reference (bad magic)")
        _, version, length = _PREFIX.unpack_from(blob)
        if version > VERSION:
            raise CorruptData(
                f"shipped-codebook reference version {version} is newer than this kvdb reads ({VERSION}); upgrade kvdb"
            )
        (crc,) = _CRC.unpack_from(blob, len(blob) - _CRC.size)
        if len(blob) != _PREFIX.size + length + _CRC.size or zlib.crc32(blob[: -_CRC.size]) != crc:
            raise CorruptData("shipped-codebook reference failed its length or CRC check")
        try:
            body = json.loads(blob[_PREFIX.size : _PREFIX.size + length])
            return cls(dict(body["recipe"]), str(body["content_sha256"]), int(body["bytes"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptData(f"shipped-codebook reference holds no recipe ({type(exc).__name__}: {exc})") from exc


def recipe(identity, preset: str | None = None) -> dict:
    """This kvdb's build recipe for a model (``identity``: its ModelRow) and a preset spec (default:
    the model's default named preset): everything the centroids depend on. An archive's reference
    may hold another chunk, size or iteration count (an older kvdb's): :func:`build` follows the
    recipe it is given."""
    return {
        "version": RECIPE_VERSION,
        "weights_hash": identity.weights_hash,
        "tokenizer_hash": identity.tokenizer_hash,
        "calibration_sha256": _calibration_sha256(),
        "preset": preset or presets.resolve(presets.DEFAULT_NAME, identity.weights_hash),
        "chunk": CHUNK,
        "positions": POSITIONS,
        "niter": NITER,
    }


@functools.cache
def _calibration_sha256() -> str:
    return hashlib.sha256(CALIBRATION.read_bytes()).hexdigest()


def recipe_key(wanted: dict) -> str:
    """A recipe's name in the machine cache (machines that build it alike share it)."""
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(key: str) -> Path:
    return cache_dir() / "codebooks" / f"{key}.rvq"


def is_built(identity, preset: str | None = None) -> bool:
    """Whether this machine has built the shipped codebooks of a model (``identity``: its ModelRow) and preset spec."""
    return cache_path(recipe_key(recipe(identity, preset))).is_file()


def cached(reference: Reference) -> KVCodebooks | None:
    """This machine's build of a reference's recipe, if it has a sound one."""
    found = _read(cache_path(reference.key))
    return None if found is None else found[1]


def _read(path: Path) -> tuple[bytes, KVCodebooks] | None:
    """A cached build, or None where there is none or it is damaged: it is derived data, built
    again from the recipe (as the prefix cache ignores a damaged entry)."""
    try:
        data = path.read_bytes()
        return data, code_layout.read_codebooks(data)
    except (OSError, CorruptData):
        return None


def buildable(wanted: dict, identity) -> bool:
    """Whether this kvdb can build a recipe for a model: its version, model and calibration text
    are this kvdb's (the preset and sizes may be any)."""
    ours = recipe(identity)
    return all(
        wanted.get(field) == ours[field]
        for field in ("version", "weights_hash", "tokenizer_hash", "calibration_sha256")
    )


def build(
    loaded, progress=None, wanted: dict | None = None, preset: str | None = None
) -> tuple[Reference, KVCodebooks, bool]:
    """(reference, codebooks, whether they were built now) for a loaded model and a recipe
    (default: this kvdb's, of ``preset``, a spec): this machine's cached build, else a new one
    (minutes on 2 cores: decision 0023; written atomically, so a concurrent first
    build is harmless). ``progress(kind, layer)`` hears of each layer trained."""
    wanted = wanted or recipe(loaded.identity, preset)
    path = cache_path(recipe_key(wanted))
    found = _read(path)
    built = found is None
    if found is None:
        books = _train(loaded, wanted, progress)
        data = books.to_bytes()
        replace_whole(path, data)
        found = data, books
    data, books = found
    return Reference(wanted, hashlib.sha256(data).hexdigest(), len(data)), books, built


def _train(loaded, wanted: dict, progress) -> KVCodebooks:
    """The recipe's codebooks: pre-RoPE K/V of the calibration text in chunks, sinks left out;
    for a transform preset, also the Fisher information of the loss over the same chunks."""
    from kvdb.model import capture

    chunk, positions = wanted["chunk"], wanted["positions"]
    ids = np.asarray(tok.encode(loaded.tokenizer, CALIBRATION.read_text(encoding="utf-8")), dtype=np.int64)
    keys, values, contexts, used = [], [], [], 0
    for at in range(0, len(ids), chunk):
        if used >= positions:
            break
        k, v = capture.capture(loaded.model, ids[at : at + chunk], pre_rope=True)
        k, v = k[:, :, capture.SINKS :], v[:, :, capture.SINKS :]  # sinks are restored exact, never coded
        take = min(k.shape[2], positions - used)
        keys.append(k[:, :, :take])
        values.append(v[:, :, :take])
        contexts.append(ids[at : at + capture.SINKS + take])
        used += take
    fisher = None
    if transform.is_transform_preset(wanted["preset"]):
        fisher = dict(zip(KINDS, capture.cache_fisher(loaded.model, contexts)))
    return code_layout.train(
        {"k": np.concatenate(keys, axis=2), "v": np.concatenate(values, axis=2)},
        wanted["preset"],
        fisher,
        niter=wanted["niter"],
        meta={"shipped": recipe_key(wanted), "tokens": used},
        progress=progress,
        threads=min(2, os.cpu_count() or 1),
    )


def codebook_set(row: CodebookRow) -> CodebookSet:
    """The record of a codebooks row: a reference to shipped codebooks says so, with the bytes
    of the centroids it stands for and whether this machine has built them."""
    if row.small_blob is not None and is_reference(row.small_blob):
        reference = Reference.from_bytes(row.small_blob)
        on_machine = cache_path(reference.key).is_file()
        return CodebookSet(
            row.codebook_id,
            row.model_id,
            row.preset,
            row.created_at,
            CodebookSource.SHIPPED,
            row.stored_bytes,
            reference.nbytes,
            on_machine,
        )
    return CodebookSet(
        row.codebook_id,
        row.model_id,
        row.preset,
        row.created_at,
        CodebookSource.TRAINED,
        row.stored_bytes,
        row.stored_bytes,
        True,
    )
