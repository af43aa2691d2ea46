"""The walk index merges slot runs, in any order and any grouping, into one sorted index: what
a reader catching up with other writers' commits relies on."""

import gc
import mmap

import numpy as np
import pytest
from support import SMAPS, resident_kib

from kvdb.codecs import fractal
from kvdb.errors import CorruptData
from kvdb.index import segment, sorting, walk
from kvdb.index.segment import REACH
from kvdb.index.stack import Stack
from kvdb.index.walk import WalkIndex

ALPHABET = 300


def _runs(rng):
    """Three runs of slots with a hole between the second and third (a node freed meanwhile)."""
    a, b, c = (rng.integers(0, 20, n) for n in (50, 30, 40))  # a small alphabet in use: many repeated keys
    return [(0, a, None), (50, b, a[-5:]), (90, c, b[-5:])], 130


def test_runs_merged_at_once_equal_runs_merged_one_by_one():
    runs, ntotal = _runs(np.random.default_rng(0))
    together = WalkIndex(ALPHABET)
    together.extend(runs[::-1], ntotal)  # any order
    one_by_one = WalkIndex(ALPHABET)
    for i, run in enumerate(runs):
        one_by_one.extend([run], ntotal if i == len(runs) - 1 else run[0] + len(run[1]))
    for got in (together, one_by_one):
        assert got.ntotal == ntotal and got.entries == 120  # the hole's 10 slots hold no keys
        for part in (got.base, got.tail):
            assert np.all(np.diff(Stack.under(part).keys_at(part.order).astype(np.float64)) >= 0)
        np.testing.assert_array_equal(got.tokens[80:90], 0)
    np.testing.assert_array_equal(np.sort(together.tail.order), np.sort(one_by_one.tail.order))
    np.testing.assert_array_equal(together.tokens[:], one_by_one.tokens[:])
    for piece in ([3], [3, 4], list(runs[2][1][7:10])):
        np.testing.assert_array_equal(together.within(np.array(piece)), one_by_one.within(np.array(piece)))
    # every slot is found by its own last tokens
    first, tokens, context = runs[1]
    path = np.concatenate([context, tokens])
    for i in range(0, len(tokens), 7):
        piece = path[len(context) + i - min(i + len(context), together.depth) + 1 : len(context) + i + 1]
        assert first + i in together.within(piece)
    assert fractal.key_depth(ALPHABET) == together.depth


def test_overlapping_runs_or_a_count_short_of_them_are_corrupt_data():
    runs, ntotal = _runs(np.random.default_rng(1))
    with pytest.raises(CorruptData, match="overlap"):
        WalkIndex(ALPHABET).extend([runs[0], (40, runs[1][1], None)], ntotal)
    with pytest.raises(CorruptData, match="slot count"):
        WalkIndex(ALPHABET).extend(runs, ntotal - 1)
    index = WalkIndex(ALPHABET)
    index.extend(runs[:1], 50)
    with pytest.raises(CorruptData):  # a run before the last slot the index holds
        index.extend([(10, runs[1][1], None)], ntotal)


def test_a_tail_merged_into_the_base_finds_what_one_segment_finds(monkeypatch):
    """Commits go to the tail; past TAIL_MIN slots and an eighth of the base it merges into the
    base. Any sequence of merges gives the entries one build gives, in the same order."""
    runs, ntotal = _runs(np.random.default_rng(2))
    whole = WalkIndex(ALPHABET)
    whole.extend(runs, ntotal)
    whole.settle()
    monkeypatch.setattr(walk, "TAIL_MIN", 10)
    merged = WalkIndex(ALPHABET)
    for i, run in enumerate(runs):
        merged.extend([run], ntotal if i == len(runs) - 1 else run[0] + len(run[1]))
    assert merged.base.ntotal > 0 and merged.ntotal == ntotal
    for piece in ([3], [3, 4], list(runs[2][1][7:10]), list(runs[0][1][:2])):
        np.testing.assert_array_equal(merged.within(np.array(piece)), whole.within(np.array(piece)))
    np.testing.assert_array_equal(merged.tokens[:], whole.tokens[:])
    np.testing.assert_array_equal(merged.tokens[np.arange(ntotal)], whole.tokens[:])


def _trie(rng, nodes: int, longest: int) -> list[tuple[int | None, np.ndarray]]:
    """(parent, tokens) of each node, parents first: three symbols in use, so paths share long
    stretches, and some nodes shorter than one key."""
    out: list[tuple[int | None, np.ndarray]] = []
    for i in range(nodes):
        parent = None if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i))
        out.append((parent, rng.integers(0, 3, int(rng.integers(1, longest))) + 7))
    return out


def _path(trie, i) -> np.ndarray:
    parts = []
    while i is not None:
        parent, tokens = trie[i]
        parts.append(tokens)
        i = parent
    return np.concatenate(parts[::-1])


def _runs_of(trie) -> tuple[list, np.ndarray, dict[int, int]]:
    """(runs as ``WalkIndex.extend`` takes them, each node's first slot, each run's parent's last slot)."""
    firsts = np.cumsum([0] + [len(t) for _, t in trie])
    runs = [
        (int(firsts[i]), tokens, None if parent is None else _path(trie, parent))
        for i, (parent, tokens) in enumerate(trie)
    ]
    return runs, firsts, {int(firsts[i]): int(firsts[p + 1]) - 1 for i, (p, _) in enumerate(trie) if p is not None}


def _grown(runs) -> WalkIndex:
    index = WalkIndex(ALPHABET)
    for run in runs:
        index.extend([run], run[0] + len(run[1]))
    return index


def _assert_ordered_and_found(trie, firsts, indexes, rng) -> None:
    """Each segment sorted by its entries' last ``REACH`` tokens, and pieces of random length
    found exactly where a scan of the paths finds them."""
    paths = [_path(trie, i) for i in range(len(trie))]
    ends = [
        (firsts[i] + j, path[: len(path) - len(trie[i][1]) + j + 1])
        for i, path in enumerate(paths)
        for j in range(len(trie[i][1]))
    ]
    for index in indexes:
        for part in index.segments:  # sorted by the last `reach` tokens, newest first
            rows = Stack.under(part).symbols(np.asarray(part.order, np.int64), np.arange(part.reach))
            assert all(tuple(a) <= tuple(b) for a, b in zip(rows[:-1].tolist(), rows[1:].tolist()))
    for _ in range(60):
        slot, path = ends[int(rng.integers(len(ends)))]
        length = int(rng.integers(1, min(REACH, len(path)) + 1))
        piece = path[len(path) - length :]
        expected = [s for s, p in ends if len(p) >= length and np.array_equal(p[len(p) - length :], piece)]
        assert slot in expected
        for index in indexes:
            assert index.within(piece).tolist() == expected, (length, piece)


@pytest.mark.parametrize(("seed", "longest"), [(0, 40), (1, 40), (2, 40), (3, 200)])
def test_pieces_up_to_the_order_s_reach_are_one_range_however_the_index_grew(monkeypatch, tmp_path, seed, longest):
    """Entries are in the order of their last ``reach`` tokens, across node boundaries: every
    piece up to that long, checked against a scan of the paths, whether the index was built at
    once (contexts kept, or every run linked to its parent), committed node by node (links
    found by lookup, into the base too), or merged, and saved and mapped. With nodes of up to
    200 tokens, paths run past ``reach`` tokens, and a node keeps only the last ``reach - 1``
    before it."""
    rng = np.random.default_rng(seed)
    trie = _trie(rng, 40, longest)
    runs, firsts, parents = _runs_of(trie)
    ntotal = int(firsts[-1])
    whole = WalkIndex(ALPHABET)
    whole.extend(runs, ntotal)
    linked = WalkIndex(ALPHABET)  # every run linked to its parent's last slot, no context kept
    linked.extend(runs, ntotal, parents=parents)
    assert (linked.tail.runs.link >= 0).sum() == len(parents) and not len(linked.tail.runs.context)
    monkeypatch.setattr(walk, "TAIL_MIN", 64 * longest // 40)
    grown = _grown(runs)
    assert grown.base.ntotal > 0 and grown.tail.entries > 0
    assert (
        longest < 200 or ((grown.tail.runs.link >= 0) & (grown.tail.runs.link < grown.tail.first)).any()
    )  # a tail's run linked into the base
    linked.settle()
    for name, index in (("linked", linked), ("grown", grown)):
        index.save(tmp_path / f"{name}.keys")
    linked, grown = (
        WalkIndex.load(tmp_path / f"{name}.keys") for name in ("linked", "grown")
    )  # the links as the files keep them
    assert longest < 200 or max(len(_path(trie, i)) for i in range(len(trie))) > 2 * whole.reach
    monkeypatch.setattr(
        walk, "SEGMENT_SLOTS", ntotal // 5
    )  # bases of a fifth: links and contexts read in the ones below
    bounded, bounded_grown = WalkIndex(ALPHABET), _grown(runs)
    bounded.extend(runs, ntotal, parents=parents)
    assert len(bounded.bases) >= 4 and len(bounded_grown.bases) >= 3
    bounded_grown.save(tmp_path / "bounded.keys")
    bounded_grown = WalkIndex.load(tmp_path / "bounded.keys")
    _assert_ordered_and_found(trie, firsts, (whole, linked, grown, bounded, bounded_grown), rng)


def test_bases_stop_growing_at_segment_slots_and_their_files_follow_each_other(monkeypatch, tmp_path):
    """A segment is sorted up to ``SEGMENT_SLOTS`` slots (past them by less than a run), then
    kept as a base; each base's file names the one before it, a file that names another is
    left out with those after it, and a save removes the files of bases the index no longer has."""
    rng = np.random.default_rng(5)
    trie = _trie(rng, 80, 40)
    runs, firsts, parents = _runs_of(trie)
    ntotal = int(firsts[-1])
    monkeypatch.setattr(walk, "SEGMENT_SLOTS", ntotal // 6)
    index = WalkIndex(ALPHABET, 5)
    index.extend(runs, ntotal, parents=parents)
    index.settle()
    newest = index.base
    index.settle()  # an empty tail: no empty base, and the newest not sorted again
    assert index.base is newest
    sizes = [base.ntotal - base.first for base in index.bases]
    assert (
        len(sizes) >= 6
        and max(sizes) < walk.SEGMENT_SLOTS + 40
        and min(sizes) > 0
        and sum(sizes) == ntotal
        and index.tail.entries == 0
    )
    path = tmp_path / "i.keys"
    index.save(path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["i.keys", "i.tail", *(f"i.{n}.keys" for n in range(1, len(sizes)))])
    assert WalkIndex.read_header(path).ntotal == WalkIndex.load(path).ntotal == ntotal
    other = WalkIndex(ALPHABET, 5)
    other.extend(runs[:20], runs[20][0], parents={k: v for k, v in parents.items() if k < runs[20][0]})
    other.settle()
    other.save(tmp_path / "o.keys")
    (tmp_path / "o.1.keys").replace(tmp_path / "i.2.keys")  # another index's second base in place of ours
    loaded = WalkIndex.load(path)
    assert len(loaded.bases) == 2 and loaded.ntotal == index.bases[1].ntotal == WalkIndex.read_header(path).ntotal
    few = WalkIndex(ALPHABET, 6)
    few.extend(runs[:3], runs[3][0])
    few.save(path)  # numbered anew: fewer bases
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("i.")) == ["i.keys", "i.tail"]
    assert WalkIndex.load(path).ntotal == runs[3][0]


def test_few_new_entries_are_placed_by_binary_search_in_the_order_a_sort_gives(monkeypatch):
    """A commit of fewer entries than a 64th of the tail's places them by binary search over 256
    tokens, read through links; here every commit does (a sampled key every 2 entries), and the
    reads and sorts go a few runs and positions at a time."""
    monkeypatch.setattr(segment, "BLOCK", 2)
    for name, value in (("_LINKS", 3), ("_CHUNK", 97), ("_PLACING", 5)):
        monkeypatch.setattr(sorting, name, value)
    monkeypatch.setattr(walk, "TAIL_MIN", 1 << 30)
    rng = np.random.default_rng(4)
    trie = _trie(rng, 60, 120)
    runs, firsts, _ = _runs_of(trie)
    placed = _grown(runs)
    assert placed.base.ntotal == 0 and (placed.tail.runs.link >= 0).any()
    _assert_ordered_and_found(trie, firsts, (placed,), rng)


def test_an_opened_index_is_mapped_not_read(tmp_path, monkeypatch):
    """Opening maps the files: the arrays are views of the mapping, so a process holds the pages
    it touches and shares them with others through the page cache. A base past CHECK_BYTES is
    not read to check its CRC when opened; `kvdb verify` (check=True) reads it."""
    runs, ntotal = _runs(np.random.default_rng(3))
    index = WalkIndex(ALPHABET, 5)
    index.extend(runs, ntotal)
    index.settle()
    path = tmp_path / "i.keys"
    index.save(path)
    loaded = WalkIndex.load(path)
    assert all(
        isinstance(getattr(a.base, "obj", None), mmap.mmap)
        for a in (loaded.base.order, loaded.base.tokens, loaded.base.samples)
    )
    np.testing.assert_array_equal(loaded.within(np.array([3, 4])), index.within(np.array([3, 4])))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last slot's token
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptData, match="integrity"):
        WalkIndex.load(path)  # small: checked when opened
    monkeypatch.setattr(segment, "CHECK_BYTES", 0)
    assert WalkIndex.load(path).ntotal == ntotal  # large: opened without reading it whole
    with pytest.raises(CorruptData, match="integrity"):
        WalkIndex.load(path, check=True)


def test_a_tail_that_follows_another_base_is_left_out(tmp_path):
    """Another writer may merge and write a new base and tail while this one opens the pair: a
    tail is used only beside the base it names, and the base alone is caught up instead."""
    runs, ntotal = _runs(np.random.default_rng(4))
    ours, theirs = WalkIndex(ALPHABET, 5), WalkIndex(ALPHABET, 5)
    for index, cut in ((ours, 1), (theirs, 2)):
        index.extend(runs[:cut], runs[cut][0])
        index.settle()
        index.extend(runs[cut:], ntotal)
        index.save(tmp_path / f"{cut}.keys")
    (tmp_path / "2.tail").replace(tmp_path / "1.tail")  # their tail beside our base
    loaded = WalkIndex.load(tmp_path / "1.keys")
    assert loaded.ntotal == loaded.base.ntotal == runs[1][0] and loaded.tail.entries == 0
    assert WalkIndex.read_header(tmp_path / "1.keys").ntotal == runs[1][0]


@pytest.mark.skipif(not SMAPS.exists(), reason="reads Linux's /proc/self/smaps")
def test_the_links_a_batch_looks_up_leave_no_page_of_the_bases_held(monkeypatch, tmp_path):
    """A batch's lookups page in most of every base a writer maps, which then counted in its RSS
    for good (a 1e8 backfill held its whole index so, decision 0073): they are let go, and the
    links found are those a fresh index finds."""
    trie = _trie(np.random.default_rng(6), 60, 700)  # paths past ``reach``: contexts looked up
    runs, firsts, parents = _runs_of(trie)
    half = len(runs) // 2
    monkeypatch.setattr(walk, "SEGMENT_SLOTS", runs[half][0] // 3)
    index = WalkIndex(ALPHABET)
    index.extend(runs[:half], runs[half][0], parents={k: v for k, v in parents.items() if k < runs[half][0]})
    index.settle()
    index.save(tmp_path / "i.keys")
    loaded = WalkIndex.load(tmp_path / "i.keys")
    del index  # its own mappings of the files (a small file's CRC read them whole)
    gc.collect()
    files = [p for p in tmp_path.iterdir() if p.suffix == ".keys"]
    assert len(loaded.bases) >= 3 and len(files) == len(loaded.bases)
    later = runs[half:]
    args = ([r[0] for r in later], [len(r[1]) for r in later], [r[2] for r in later], {})
    for base in loaded.bases:  # as a writer's lookups leave them
        int(np.asarray(base.order).sum()) + int(np.asarray(base.tokens).sum())
    assert resident_kib(files) > 0
    links = loaded.run_table(*args).link
    assert (links >= 0).sum() > len(later) // 3 and resident_kib(files) == 0
    in_memory = WalkIndex(ALPHABET)
    in_memory.extend(runs[:half], runs[half][0], parents={k: v for k, v in parents.items() if k < runs[half][0]})
    in_memory.settle()
    np.testing.assert_array_equal(links, in_memory.run_table(*args).link)
