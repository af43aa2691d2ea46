"""The sidecar format (kvdb/index/sidecar.py) that the phrase index's segments and the semantic
tier's chunk index share: a round trip gives back every array, mapped and aligned; a flipped
byte, a cut file, another magic or a damaged header is refused with ``CorruptData`` naming the
file and the remedy; a failed write leaves the old file; files of the layouts before it read."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from support import SMAPS, resident_kib

from kvdb.errors import CorruptData
from kvdb.index import ranking, sidecar
from kvdb.index.chunk_index import ChunkIndex
from kvdb.index.walk import WalkIndex, tail_path

GOLDEN = Path(__file__).parents[1] / "fixtures/golden"
MAGIC = b"KVDBTEST"


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "small": np.arange(5, dtype="<u2"),  # 10 bytes: the next array starts past padding
        "vectors": rng.standard_normal((7, 3)).astype(np.float16),
        "flags": np.array([True, False, True]),
        "names": np.array([b"ab", b"cde"]),
        "empty": np.zeros((0, 4), np.int64),
        "counts": np.arange(9, dtype="<u8")[::2],  # not contiguous: written as if it were
    }


def _written(tmp_path: Path, checked=None) -> Path:
    path = tmp_path / "x.bin"
    sidecar.write(path, MAGIC, {"kind": "test", "n": 3}, _arrays(), checked)
    return path


def _flipped(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _place(path: Path, name: str) -> int:
    """Where array ``name`` starts in the file."""
    length = struct.unpack_from("<I", path.read_bytes(), 8)[0]
    header = json.loads(path.read_bytes()[12 : 12 + length])
    return -(-(12 + length) // sidecar.ALIGN) * sidecar.ALIGN + header["arrays"][name]["offset"]


def test_a_round_trip_gives_back_every_array_mapped_and_aligned(tmp_path):
    path = _written(tmp_path)
    read = sidecar.read(path, MAGIC)
    assert read.magic == MAGIC and read.header["kind"] == "test" and read.header["n"] == 3
    assert list(read.arrays) == list(_arrays())
    for name, array in _arrays().items():
        got = read.arrays[name]
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
        assert not got.flags.writeable  # a view of the file's read-only mapping
        assert _place(path, name) % sidecar.ALIGN == 0
    assert sidecar.header(path, (MAGIC,)) == (MAGIC, read.header)
    assert path.stat().st_size == _place(path, "counts") + 5 * 8  # no padding after the last array
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temporary file left


@pytest.mark.skipif(not SMAPS.exists(), reason="reads Linux's /proc/self/smaps")
def test_pages_a_read_mapped_in_are_let_go_and_read_again_alike(tmp_path):
    path = tmp_path / "big.bin"
    values = np.random.default_rng(1).integers(0, 1 << 30, 1 << 20, dtype=np.int64)  # 8 MiB
    sidecar.write(path, MAGIC, {"kind": "test"}, {"values": values})
    read = sidecar.read(path, MAGIC, check_up_to=0)  # no CRC: the sum below is the only read
    assert int(read.arrays["values"].sum()) == int(values.sum())
    assert resident_kib([path]) >= 6 << 10  # the sum paged the file in: it counts in this process's RSS
    read.let_pages_go()
    assert resident_kib([path]) < 1 << 10
    assert np.array_equal(read.arrays["values"], values)  # read again from the page cache, the same


def test_a_flipped_byte_in_a_checked_array_is_refused(tmp_path):
    path = _written(tmp_path)
    _flipped(path, _place(path, "vectors") + 5)
    with pytest.raises(CorruptData, match="integrity") as caught:
        sidecar.read(path, MAGIC)
    assert str(path) in str(caught.value) and "kvdb repair" in str(caught.value)
    assert sidecar.read(path, MAGIC, check_up_to=path.stat().st_size - 1).arrays["small"].tolist() == list(
        range(5)
    )  # large: not read whole
    with pytest.raises(CorruptData, match="integrity"):
        sidecar.read(path, MAGIC, check_up_to=path.stat().st_size)


def test_the_reader_says_which_arrays_the_crc_covers(tmp_path):
    """The coverage is the kind's rule, given to reader and writer alike: a byte of an array
    outside it is not checked (the chunk index's vectors: a CRC would read GBs an open)."""
    path = _written(tmp_path, checked=("small", "names"))
    _flipped(path, _place(path, "vectors"))
    assert not np.array_equal(
        sidecar.read(path, MAGIC, checked=("small", "names")).arrays["vectors"], _arrays()["vectors"]
    )
    _flipped(path, _place(path, "names"))
    with pytest.raises(CorruptData, match="integrity"):
        sidecar.read(path, MAGIC, checked=("small", "names"))


@pytest.mark.parametrize("keep", [3, 12, 40, -1])  # in the magic, in the length, in the header, in the last array
def test_a_cut_file_is_refused(tmp_path, keep):
    path = _written(tmp_path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CorruptData, match="cut short|not a sidecar") as caught:
        sidecar.read(path, MAGIC)
    assert "kvdb repair" in str(caught.value)


def test_another_magic_or_version_is_refused(tmp_path):
    path = _written(tmp_path)
    with pytest.raises(CorruptData, match=r"not a sidecar .*KVDBTESU.*another version"):
        sidecar.read(path, b"KVDBTESU")  # a reader of another version of the kind
    with pytest.raises(CorruptData, match="not a sidecar"):
        sidecar.header(path, (b"KVDBTESU",))
    path.write_bytes(b"PK\x03\x04" + path.read_bytes()[4:])
    with pytest.raises(CorruptData, match="not a sidecar"):
        sidecar.read(path, MAGIC)


@pytest.mark.parametrize(
    "damage",
    [
        lambda h: h.replace(b'"kind"', b"'kind'"),  # not JSON
        lambda h: h.replace(b'"offset": 0', b'"offset": 9999999'),  # past the end
        lambda h: h.replace(b'"shape": [5]', b'"shape": [-5]'),
        lambda h: h.replace(b'"dtype": "<u2"', b'"dtype": "<zz"'),
        lambda h: h.replace(b'"arrays"', b'"arrayz"'),
    ],
)
def test_a_damaged_header_is_refused(tmp_path, damage):
    path = _written(tmp_path)
    data = path.read_bytes()
    length = struct.unpack_from("<I", data, 8)[0]
    header = damage(data[12 : 12 + length])
    path.write_bytes(data[:8] + struct.pack("<I", len(header)) + header + data[12 + length :])
    with pytest.raises(CorruptData, match="kvdb repair"):
        sidecar.read(path, MAGIC)


def test_a_missing_file_is_refused_by_read_and_raised_by_header(tmp_path):
    with pytest.raises(CorruptData, match="cannot be read"):
        sidecar.read(tmp_path / "none", MAGIC)
    with pytest.raises(OSError):
        sidecar.header(tmp_path / "none", (MAGIC,))


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = _written(tmp_path)
    old = path.read_bytes()
    mapped = sidecar.read(path, MAGIC)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sidecar.os, "fsync", full)
    with pytest.raises(OSError):
        sidecar.write(path, MAGIC, {"kind": "new"}, {"small": np.ones(3, np.uint8)})
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["x.bin"]
    monkeypatch.undo()
    sidecar.write(path, MAGIC, {"kind": "new"}, {"small": np.ones(3, np.uint8)})
    assert sidecar.read(path, MAGIC).header["kind"] == "new"
    assert np.array_equal(mapped.arrays["vectors"], _arrays()["vectors"])  # a reader's mapping keeps the file it opened


def test_the_format_keeps_its_own_keys(tmp_path):
    with pytest.raises(ValueError, match="fields other than"):
        sidecar.write(tmp_path / "x", MAGIC, {"crc32": 1}, {})
    with pytest.raises(ValueError, match="8-byte magic"):
        sidecar.write(tmp_path / "x", b"KVDB", {}, {})


def test_an_older_layout_reads_through_its_magic(tmp_path):
    """A format from before the table: arrays end to end from the header's end, placed by the
    kind's rule from its counts; its length must be exactly theirs."""
    a, b = np.arange(4, dtype="<u4"), np.arange(3, dtype="<u2")
    header = json.dumps({"n": 4, "m": 3, "crc32": sidecar._crc32({"a": a, "b": b}, None)}).encode()
    path = tmp_path / "old.bin"
    path.write_bytes(b"KVDBOLD1" + struct.pack("<I", len(header)) + header + a.tobytes() + b.tobytes())
    older = {b"KVDBOLD1": lambda h: {"a": (np.dtype("<u4"), (h["n"],)), "b": (np.dtype("<u2"), (h["m"],))}}
    read = sidecar.read(path, MAGIC, older=older)
    assert (
        read.magic == b"KVDBOLD1"
        and read.arrays["a"].tolist() == [0, 1, 2, 3]
        and read.arrays["b"].tolist() == [0, 1, 2]
    )
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(CorruptData, match="another length"):
        sidecar.read(path, MAGIC, older=older)


def test_a_search_index_of_the_layout_before_takes_a_commit(tmp_path):
    """A KVDBIDX6 base (kvdb before this module) is read, not rebuilt; the tail a commit writes
    beside it is of today's format and names it."""
    base = tmp_path / "a259.keys"
    shutil.copy(GOLDEN / "index/v6/a259.keys", base)
    shutil.copy(GOLDEN / "index/v6/a259.tail", tail_path(base))
    index = WalkIndex.load(base, check=True)
    added = np.array([256, 257, 258, 256], np.int64)
    stream = np.concatenate([index.tokens[:], added])
    index.add(added)
    index.save(base)
    assert base.read_bytes() == (GOLDEN / "index/v6/a259.keys").read_bytes() and tail_path(
        base
    ).read_bytes().startswith(b"KVDBIDX7")
    again = WalkIndex.load(base, check=True)
    assert again.ntotal == len(stream) and np.array_equal(again.tokens[:], stream)
    assert again.within(added[-2:]).tolist() == index.within(added[-2:]).tolist()


def test_a_chunk_index_written_before_the_module_opens():
    """tests/fixtures/golden/chunks/v1.vec: a KVDBCHK1 file kvdb wrote before sidecar.py (7 rows,
    the first node's 3 dropped), whose layout became the sidecar format unchanged."""
    loaded = ChunkIndex.load(GOLDEN / "chunks/v1.vec")
    assert loaded.rows == 7 and loaded.live.tolist() == [False] * 3 + [True] * 4
    assert loaded.counts() == {f"{1:032x}": 3, f"{2:032x}": 1}
    fresh = ranking.BM25()
    fresh.add(
        ["split_path joins paths", "hello world again", "the cat sat on the mat", "dogs bark at the postman"]
    )  # rows 3 to 6
    for query in ("cat", "split path", "the postman"):
        assert np.allclose(loaded.words.scores(query), np.concatenate([np.zeros(3), fresh.scores(query)]))
    assert loaded.nearest(np.ones(4, np.float32), 7)[0].min() >= 3
