"""The semantic tier's sidecar: a round trip keeps every answer, tombstones leave both
retrievers and BM25's counts (scores equal a build over the rows left), a damaged file is
refused, and an inverted file is saved trained and takes rows without training again."""

import mmap

import numpy as np
import pytest

from kvdb.errors import CorruptData
from kvdb.index import ranking
from kvdb.index import vectors as vector_ops
from kvdb.index.chunk_index import ChunkHeader, ChunkIndex

TEXTS = [
    "the cat sat on the mat",
    "dogs bark at the postman",
    "a cat and a dog met",
    "split_path joins paths",
    "hello world again",
]


def _unit(rng, n: int, dim: int = 16) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _index(rng, n: int = 20) -> ChunkIndex:
    nodes = [f"{i // 3:032x}" for i in range(n)]  # three chunks a node
    return ChunkIndex.build(
        "embedder@1", nodes, np.arange(2 * n).reshape(n, 2), _unit(rng, n), [TEXTS[i % len(TEXTS)] for i in range(n)]
    )


def test_a_saved_index_answers_as_the_one_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    index, query = _index(rng), _unit(rng, 1)[0]
    index.save(tmp_path / "x.vec")
    loaded = ChunkIndex.load(tmp_path / "x.vec")
    assert loaded.counts() == index.counts() == {f"{i:032x}": 3 for i in range(6)} | {f"{6:032x}": 2}
    assert np.array_equal(loaded.nearest(query, 5)[0], index.nearest(query, 5)[0])
    assert np.array_equal(loaded.words.scores("cat dog"), index.words.scores("cat dog"))
    assert np.array_equal(loaded.spans, index.spans) and np.array_equal(loaded.vectors, index.vectors)
    assert ChunkIndex.read_header(tmp_path / "x.vec") == ChunkHeader("embedder@1", 20, 20)


def test_tombstones_leave_both_retrievers_and_the_word_counts(tmp_path):
    rng = np.random.default_rng(1)
    index = _index(rng)
    dropped = [f"{0:032x}", f"{2:032x}"]
    index.drop(dropped)
    left = np.flatnonzero(index.live)
    assert index.counts().keys().isdisjoint(dropped) and len(left) == 14
    fresh = ranking.BM25()
    fresh.add([TEXTS[i % len(TEXTS)] for i in left])
    for query in ("cat dog", "the postman", "split path"):
        scores = index.words.scores(query)
        assert np.allclose(scores[left], fresh.scores(query)) and not scores[~index.live].any()
    rows, _ = index.nearest(index.vectors[0].astype(np.float32), 20)  # row 0 is a tombstone
    assert sorted(rows.tolist()) == left.tolist()
    index.append([f"{9:032x}"], np.array([[90, 91]]), _unit(rng, 1), ["a cat"])
    index.save(tmp_path / "x.vec")
    loaded = ChunkIndex.load(tmp_path / "x.vec")
    assert loaded.counts() == index.counts() and np.array_equal(loaded.words.scores("cat"), index.words.scores("cat"))
    assert not loaded.outgrown(0)  # 6 tombstones, 15 live rows
    index.drop([f"{i:032x}" for i in range(1, 5)])
    assert index.outgrown(0)  # tombstones outnumber the live rows


def test_an_inverted_file_is_saved_trained_and_takes_rows_without_training(tmp_path, monkeypatch):
    monkeypatch.setattr(vector_ops, "FLAT_UP_TO", 50)
    rng = np.random.default_rng(2)
    index = _index(rng, 200)
    assert vector_ops.trained(index.index) and index.trained_for == 200
    index.save(tmp_path / "x.vec")
    loaded = ChunkIndex.load(tmp_path / "x.vec")
    assert vector_ops.trained(loaded.index) and loaded.index.ntotal == 200
    centroids = loaded.index.quantizer.reconstruct_n(0, loaded.index.nlist)
    loaded.append([f"{999:032x}"], np.array([[0, 1]]), _unit(rng, 1), ["new"])
    assert np.array_equal(loaded.index.quantizer.reconstruct_n(0, loaded.index.nlist), centroids)
    assert loaded.nearest(loaded.vectors[-1].astype(np.float32), 1)[0].tolist() == [200]
    assert not loaded.outgrown(0) and loaded.outgrown(4 * 200)  # past 4x the rows it was trained for


@pytest.mark.parametrize("damage", ["magic", "header", "cut", "counted"])
def test_a_damaged_sidecar_is_refused(tmp_path, damage):
    _index(np.random.default_rng(3)).save(tmp_path / "x.vec")
    data = bytearray((tmp_path / "x.vec").read_bytes())
    if damage == "magic":
        data[:8] = b"KVDBXXXX"
    elif damage == "header":
        data[12:20] = b"########"
    elif damage == "cut":
        data = data[: len(data) // 2]
    else:  # a byte of the checked arrays: the node ids, first after the header
        at = data.index(b"0000000000000000")
        data[at] ^= 1
    (tmp_path / "x.vec").write_bytes(bytes(data))
    with pytest.raises(CorruptData):
        ChunkIndex.load(tmp_path / "x.vec")


def test_appends_to_a_loaded_index_copy_none_of_its_vectors(tmp_path):
    """Issue 53: a catch-up appends to the rows a sidecar maps, into a buffer that doubles; the
    mapped vectors stay mapped, and every read sees the rows in order."""
    rng = np.random.default_rng(4)
    _index(rng, 20).save(tmp_path / "x.vec")
    loaded = ChunkIndex.load(tmp_path / "x.vec")
    base = loaded.vectors.base
    added = [_unit(rng, 3) for _ in range(5)]
    for k, vectors in enumerate(added):
        loaded.append([f"{100 + k:032x}"] * 3, np.arange(6).reshape(3, 2) + 100 * k, vectors, ["a", "b", "c"])
    assert loaded.vectors.base is base and _mapped(base)  # not copied
    every = np.concatenate([np.asarray(base), *(v.astype(np.float16) for v in added)])
    assert loaded.rows == len(loaded.vectors) == len(every) == 35 and np.array_equal(loaded.vectors.whole(), every)
    rows = np.array([0, 19, 20, 34, 7, 25])
    assert np.array_equal(loaded.vectors[rows], every[rows]) and np.array_equal(loaded.vectors[-1], every[-1])
    assert loaded.spans[-1].tolist() == [404, 405] and loaded.live.all() and len(loaded.row_node) == 35
    loaded.save(tmp_path / "y.vec")
    again = ChunkIndex.load(tmp_path / "y.vec")
    assert np.array_equal(np.asarray(again.vectors.base), every) and again.counts() == loaded.counts()


def _mapped(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of a file's mapping (through any views between)."""
    owner: object = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return isinstance(getattr(owner, "obj", owner), mmap.mmap)
