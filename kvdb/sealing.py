"""Encryption at rest of the files kvdb writes beside an encrypted archive (decision 0063).

An archive opened with a key (``$KVDB_KEY``, or ``kvdb --key-file``) has a seal file beside it,
``<archive>.seal``: plain JSON holding no secret, only the per-archive salt the key is stretched
with (scrypt) and a check value, so that a wrong key is one clear error before any byte is read.
From the stretched key come two: DuckDB's (its own database encryption of the file and its
write-ahead log) and the files' (AES-256-GCM over every sidecar, serve journal entry and
prefix-cache entry). The seal file is part of the archive: without it the key opens nothing.

A sealed file is ``MAGIC``, an 8-byte random nonce prefix, then the plaintext in chunks of
``CHUNK`` bytes, each encrypted with the nonce prefix and its index and followed by its 16-byte
tag; the last chunk says it is last (its associated data), so a file cut at a chunk boundary fails
as surely as a flipped bit. Chunks bound the memory of a write and let a reader decrypt only the
chunks it reads (a header), and keep each encryption far below AES-GCM's 64 GiB limit.

Which files are sealed is decided by their place: the writers and readers (``index/sidecar.py``,
``services/journal.py``, ``model/prefix_cache.py``) ask ``writing``/``reading`` for the path they
touch, and every path beside an archive registered with a key is sealed. The registry keeps
those kernel-level modules free of any knowledge of archives and keys, at the price of a
process-wide table (an archive's storage registers itself when it opens).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import io
import json
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from kvdb.errors import ArchiveKeyError, CorruptData

SEAL_SUFFIX = ".seal"
SEAL_VERSION = 1
MAGIC = b"KVDBSEL1"
CHUNK = 1 << 20  # plaintext bytes per chunk: a 16-byte tag each (0.0015 %)
_PREFIX = 8  # random nonce prefix; a chunk's nonce is it and the chunk's index (u32)
_TAG = 16
_START = len(MAGIC) + _PREFIX
# scrypt's cost: its time and 16 MiB once per process and archive, per guess for an attacker (decision 0063)
SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}
KEY_ENV = "KVDB_KEY"
_HOW = f"set ${KEY_ENV} or give --key-file"


def given_key(key: str | bytes | None) -> bytes | None:
    """The key as given, else ``$KVDB_KEY``'s; None for a plain archive, as is an empty key given
    (plain, whatever ``$KVDB_KEY`` says). Text is taken as its UTF-8 bytes, without the line end a
    key file or a shell's ``$(cat ...)`` leaves."""
    if key is None:
        key = os.environ.get(KEY_ENV, "")
    raw = key.encode() if isinstance(key, str) else bytes(key)
    return raw.rstrip(b"\r\n") or None


def read_key_file(path: str | Path) -> bytes:
    try:
        key = Path(path).read_bytes().rstrip(b"\r\n")
    except OSError as exc:
        raise ArchiveKeyError(f"cannot read the key file {path} ({exc.strerror or exc}); check --key-file") from exc
    if not key:
        raise ArchiveKeyError(
            f"the key file {path} is empty; put the archive's key in it (e.g. `openssl rand -base64 32 > {path}`)"
        )
    return key


class Seal:
    """An archive's two keys, stretched from the user's: DuckDB's, and its files' cipher."""

    def __init__(self, stretched: bytes):
        self.database_key = _expand(stretched, b"kvdb database").hex()
        self._files = AESGCM(_expand(stretched, b"kvdb files"))

    def encrypt(self, prefix: bytes, index: int, chunk, last: bool) -> bytes:
        return self._files.encrypt(_nonce(prefix, index), chunk, _aad(last))

    def decrypt_into(self, prefix: bytes, index: int, sealed, last: bool, into: memoryview) -> None:
        """``ValueError`` where the chunk's plaintext is not ``into``'s length (a file cut short)."""
        into[:] = self._files.decrypt(_nonce(prefix, index), sealed, _aad(last))


def seal_path(archive: Path) -> Path:
    return archive.with_name(archive.name + SEAL_SUFFIX)


def open_seal(archive: Path, key: bytes | None, create: bool) -> Seal | None:
    """The seal of the archive file at ``archive`` under ``key``; None for a plain one.
    ``create``: the archive is new, and is made encrypted when a key is given. Raises
    ``ArchiveKeyError`` for a key missing, wrong, or given to a plain archive."""
    path = seal_path(archive)
    if create and key is not None:
        salt = secrets.token_bytes(16)
        stretched = _stretch(key, salt, SCRYPT["n"], SCRYPT["r"], SCRYPT["p"])
        record = {"kvdb_seal": SEAL_VERSION, "kdf": "scrypt", **SCRYPT, "salt": salt.hex(), "check": _check(stretched)}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        try:
            os.link(tmp, path)  # never over another's: two processes creating one archive at once share the first one's
            return Seal(stretched)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    if not path.exists():
        if key is not None:
            raise ArchiveKeyError(
                f"{archive} is not encrypted (no {path.name} beside it): open it without a key "
                f"(unset ${KEY_ENV}, drop --key-file), "
                "or write an encrypted copy with `kvdb copy --encrypt`"
            )
        return None
    left = "" if archive.exists() else f" (or, for a new archive, remove {path.name}: a deleted archive's)"
    if key is None:
        raise ArchiveKeyError(f"{archive} is encrypted: {_HOW} to open it{left}")
    try:
        record = json.loads(path.read_text())
        if record.get("kvdb_seal") != SEAL_VERSION or record.get("kdf") != "scrypt":
            raise ArchiveKeyError(
                f"{path} is of another kvdb version ({record.get('kvdb_seal')!r}); upgrade kvdb to open {archive}"
            )
        stretched = _stretch(key, bytes.fromhex(record["salt"]), int(record["n"]), int(record["r"]), int(record["p"]))
        wrong = not hmac.compare_digest(_check(stretched), str(record["check"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArchiveKeyError(
            f"{path}, which holds the salt of {archive}'s key, is damaged ({exc!r}); "
            "restore it from a copy of the archive"
        ) from exc
    if wrong:
        raise ArchiveKeyError(
            f"the key does not open {archive} (wrong key); {_HOW} with the key it was encrypted with{left}"
        )
    return Seal(stretched)


# which files are sealed --------------------------------------------------------------
# an archive's path (absolute) -> its seal (None: plain), for the files beside it
_archives: dict[str, Seal | None] = {}


def register(archive: Path, seal: Seal | None) -> None:
    """The files beside ``archive`` (``<archive>.index/``, ``.serve/``, ``.prefix/``...) are
    sealed with ``seal`` from now on in this process; None: they are plain."""
    _archives[os.path.abspath(archive)] = seal


def seal_for(path: Path) -> Seal | None:
    """The seal of the archive ``path`` lies beside (``<archive><suffix>``: the longest such
    archive's, so ``a.duckdb.bak``'s files are not ``a.duckdb``'s); None where it is plain."""
    if not any(_archives.values()):
        return None
    where = os.path.abspath(path)
    owners = [a for a in _archives if where.startswith(a) and where[len(a) : len(a) + 1] in ("", ".")]
    return _archives[max(owners, key=len)] if owners else None


@contextlib.contextmanager
def writing(path: Path, sync: bool = False) -> Iterator[BinaryIO]:
    """A new file at ``path``, written front to back, sealed when its archive is encrypted;
    finished (and fsynced where ``sync``) when the block ends without an error."""
    seal = seal_for(path)
    with open(path, "wb") as f:
        out: BinaryIO = f if seal is None else _SealedWriter(f, seal)  # type: ignore[assignment]
        yield out
        if isinstance(out, _SealedWriter):
            out.finish()
        if sync:
            f.flush()
            os.fsync(f.fileno())


def reading(path: Path) -> io.BufferedReader:
    """``path`` open for reading: its plaintext, decrypted chunk by chunk as it is read where its
    archive is encrypted. ``OSError`` as ``open``; ``CorruptData`` for a sealed file that fails
    its authentication, or a plain file where a sealed one belongs (written before the archive
    was encrypted: derived data to build again)."""
    seal = seal_for(path)
    f = open(path, "rb")
    if seal is None:
        return f
    try:
        return io.BufferedReader(_SealedReader(f, seal, path), CHUNK)
    except BaseException:
        f.close()
        raise


def contents(f: io.BufferedReader):
    """The whole plaintext of a file from ``reading``, as a read-only buffer: a mapping of a
    plain file (a query pages in what it reads), the decrypted bytes of a sealed one (all of it
    read and decrypted at once, as fast as AES-GCM runs on one core (decision 0063), and held in memory)."""
    if isinstance(f.raw, _SealedReader):
        return f.raw.whole()
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class _SealedWriter(io.RawIOBase):
    """Encrypts what it is given into whole chunks as they fill; the last one on ``finish``."""

    def __init__(self, f: BinaryIO, seal: Seal):
        self._f, self._seal = f, seal
        self._prefix = secrets.token_bytes(_PREFIX)
        self._index = 0
        self._pending = bytearray()
        f.write(MAGIC + self._prefix)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        at = 0
        while at < len(view):
            if len(self._pending) == CHUNK:  # more follows: it was not the last
                self._emit(self._pending, False)
                self._pending = bytearray()
            if not self._pending and len(view) - at > CHUNK:  # a whole chunk straight from the caller's buffer
                self._emit(view[at : at + CHUNK], False)
                at += CHUNK
                continue
            take = min(CHUNK - len(self._pending), len(view) - at)
            self._pending += view[at : at + take]
            at += take
        return len(view)

    def finish(self) -> None:
        self._emit(self._pending, True)

    def _emit(self, chunk, last: bool) -> None:
        self._f.write(self._seal.encrypt(self._prefix, self._index, chunk, last))
        self._index += 1


class _SealedReader(io.RawIOBase):
    def __init__(self, f: BinaryIO, seal: Seal, path: Path):
        self._f, self._seal, self._path = f, seal, path
        head = f.read(_START)
        if head[: len(MAGIC)] != MAGIC:
            raise CorruptData(
                f"{path} is not encrypted, but its archive is (written before it was, or by a kvdb without its key)"
            )
        self._prefix = head[len(MAGIC) :]
        body = os.fstat(f.fileno()).st_size - _START
        self._chunks = max(1, -(-body // (CHUNK + _TAG)))
        self.size = body - self._chunks * _TAG
        if self.size < max(0, (self._chunks - 1) * CHUNK):  # the last chunk's tag, or more, is missing
            raise CorruptData(f"{path} is cut short (sealed, {body + _START} bytes)")
        self._pos = 0
        self._cached: tuple[int, bytearray] | None = None
        if not self.size:  # no read would ever authenticate it
            self._decrypt(0, memoryview(bytearray()))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence] + offset
        return self._pos

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out) and self._pos < self.size:
            index, at = divmod(self._pos, CHUNK)
            chunk = self._chunk(index)
            n = min(len(out) - done, len(chunk) - at)
            out[done : done + n] = chunk[at : at + n]
            done += n
            self._pos += n
        return done

    def whole(self) -> memoryview:
        plain = bytearray(self.size)
        view = memoryview(plain)
        for index in range(self._chunks):
            start = index * CHUNK
            self._decrypt(index, view[start : min(start + CHUNK, self.size)])
        return view.toreadonly()

    def _chunk(self, index: int) -> bytearray:
        if self._cached is None or self._cached[0] != index:
            plain = bytearray(min(CHUNK, self.size - index * CHUNK))
            self._decrypt(index, memoryview(plain))
            self._cached = (index, plain)
        return self._cached[1]

    def _decrypt(self, index: int, into: memoryview) -> None:
        self._f.seek(_START + index * (CHUNK + _TAG))
        sealed = self._f.read(len(into) + _TAG)
        try:
            self._seal.decrypt_into(self._prefix, index, sealed, index == self._chunks - 1, into)
        except (InvalidTag, ValueError) as exc:
            raise CorruptData(f"{self._path} failed its authentication (damaged, or sealed under another key)") from exc

    def close(self) -> None:
        self._f.close()
        super().close()


def _nonce(prefix: bytes, index: int) -> bytes:
    return prefix + index.to_bytes(4, "big")


def _aad(last: bool) -> bytes:
    return MAGIC + (b"\x01" if last else b"\x00")


@functools.lru_cache(maxsize=8)
def _stretch(key: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    """scrypt, once per process for a key and salt (storages reopen an archive often)."""
    return Scrypt(salt=salt, length=32, n=n, r=r, p=p).derive(key)


def _expand(stretched: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(stretched)


def _check(stretched: bytes) -> str:
    return _expand(stretched, b"kvdb key check")[:16].hex()
