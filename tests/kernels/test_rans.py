"""kvdb.codecs.rans: exact round trips, streams at the cross-entropy, docs/formats.md followed to
the letter (a decoder written from it reads what the C encoder writes), damage refused."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from kvdb.codecs import rans
from kvdb.errors import CorruptData, InvalidArgument

pytestmark = pytest.mark.skipif(not rans.available(), reason="kvdb.codecs._rans is not built")

EXTREMES = [-32768, -32767, -129, -128, -127, -1, 0, 1, 127, 128, 129, 32767]


def random_tables(rng: np.random.Generator, k: int) -> rans.Tables:
    """Peaked tables with many zero entries, as calibration gives."""
    spread = rng.uniform(0.5, 40, size=(k, 1))
    counts = np.floor(1e5 * np.exp(-np.abs(np.arange(256) - 127) / spread)).astype(np.int64)
    counts[rng.random((k, 256)) < 0.2] = 0
    return rans.Tables(rans.frequencies(counts))


def random_values(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Mostly small values, some out to ±300, and the int16 extremes sprinkled in."""
    v = np.rint(rng.laplace(0, rng.uniform(0.3, 60, size=(rows, 1)), (rows, n))).clip(-300, 300).astype(np.int16)
    flat = v.reshape(-1)
    if flat.size:
        flat[rng.integers(0, flat.size, 8)] = rng.choice(EXTREMES, 8)
    return v


def dominant_table(symbol: int) -> np.ndarray:
    """One symbol takes 4095 of 4096, ESCAPE the last one."""
    f = np.zeros(256, np.int64)
    f[symbol], f[rans.ESCAPE] = 4095, 1
    return f


def round_trip(values: np.ndarray, classes: np.ndarray, tables: rans.Tables) -> bytes:
    data = rans.encode(values, classes, tables)
    np.testing.assert_array_equal(rans.decode(data, classes, values.shape[1], tables), values)
    return data


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_tables_and_values_round_trip(seed):
    rng = np.random.default_rng(seed)
    tables = random_tables(rng, int(rng.integers(1, 65)))
    rows, n = int(rng.integers(1, 40)), int(rng.integers(1, 300))
    values = random_values(rng, rows, n)
    classes = rng.integers(0, tables.classes, rows).astype(np.int32)
    data = round_trip(values, classes, tables)
    used = int(rng.integers(0, n + 1))
    np.testing.assert_array_equal(rans.decode(data, classes, n, tables, used=used), values[:, :used])


def test_every_int16_extreme_codes_in_every_kind_of_table():
    tables = rans.Tables(
        np.stack(
            [
                dominant_table(127),
                dominant_table(0),
                dominant_table(254),
                rans.frequencies(np.zeros((1, 256), np.int64))[0],
            ]
        )
    )
    values = np.array([EXTREMES] * 4, dtype=np.int16)
    round_trip(values, np.arange(4, dtype=np.int32), tables)
    round_trip(values[::-1].copy(), np.arange(4, dtype=np.int32), tables)


def test_a_dominant_table_codes_its_symbol_in_almost_no_bits():
    tables = rans.Tables(dominant_table(127)[None])
    values = np.zeros((4, 10_000), dtype=np.int16)
    data = round_trip(values, np.zeros(4, np.int32), tables)
    assert len(data) <= 8 + 40_000 * np.log2(4096 / 4095) / 8 + 4


def test_a_value_whose_entry_is_zero_codes_as_an_escape():
    f = dominant_table(127)
    tables = rans.Tables(f[None])
    values = np.array([[0, 5, -3, 0, 127, -127]], dtype=np.int16)  # 5, -3, 127, -127 have frequency 0
    data = round_trip(values, np.zeros(1, np.int32), tables)
    assert reference_decode(data, [0], 6, f[None]) == values.tolist()


def test_no_values_is_the_two_starting_states():
    tables = rans.Tables(dominant_table(127)[None])
    for rows, n in ((0, 5), (3, 0), (0, 0)):
        classes = np.zeros(rows, np.int32)
        data = rans.encode(np.zeros((rows, n), np.int16), classes, tables)
        assert data == bytes.fromhex("0000010000000100")
        assert rans.decode(data, classes, n, tables).shape == (rows, n)


def test_used_keeps_the_first_values_of_each_row_and_checks_the_whole_stream():
    rng = np.random.default_rng(7)
    tables = random_tables(rng, 3)
    values = random_values(rng, 5, 50)
    classes = np.array([0, 1, 2, 1, 0], np.int32)
    data = rans.encode(values, classes, tables)
    for used in (0, 1, 17, 50):
        np.testing.assert_array_equal(rans.decode(data, classes, 50, tables, used=used), values[:, :used])
    with pytest.raises(CorruptData):
        rans.decode(data[:-2], classes, 50, tables, used=1)  # the values not kept must still be there


def test_decode_into_writes_recon_and_escapes_times_the_step_into_a_strided_view():
    rng = np.random.default_rng(3)
    tables = random_tables(rng, 4)
    rows, n, used = 6, 40, 30
    values = random_values(rng, rows, n)
    classes = rng.integers(0, 4, rows).astype(np.int32)
    data = rans.encode(values, classes, tables)
    recon = rng.standard_normal((4, 256)).astype(np.float32)
    buffer = np.full((rows, 100), -7.0, np.float32)
    out = buffer[:, 10 : 10 + used]
    rans.decode_into(data, classes, n, tables, recon, 0.25, out)
    kept = values[:, :used].astype(np.int64)
    has_symbol = (np.abs(kept) <= 127) & (tables.freqs[classes[:, None], np.clip(kept + 127, 0, 254)] > 0)
    expected = np.where(
        has_symbol, recon[classes[:, None], np.clip(kept + 127, 0, 254)], kept.astype(np.float32) * np.float32(0.25)
    )
    np.testing.assert_array_equal(out, expected)
    assert (~has_symbol).any()  # the case exercised escapes
    assert (buffer[:, :10] == -7).all() and (buffer[:, 10 + used :] == -7).all()


def test_two_threads_decode_at_once():
    rng = np.random.default_rng(11)
    tables = random_tables(rng, 8)
    jobs = []
    for _ in range(2):
        values = random_values(rng, 64, 2000)
        classes = rng.integers(0, 8, 64).astype(np.int32)
        jobs.append((values, classes, rans.encode(values, classes, tables)))
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        values, classes, data = jobs[i]
        for _ in range(5):
            results[i] = rans.decode(data, classes, values.shape[1], tables)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (values, _, _) in enumerate(jobs):
        np.testing.assert_array_equal(results[i], values)


# -- size ----------------------------------------------------------------------------------


def cross_entropy_bytes(values: np.ndarray, classes: np.ndarray, freqs: np.ndarray) -> float:
    """The information in ``values`` under the tables, as docs/formats.md codes them."""
    v = values.astype(np.int64)
    f = freqs[classes[:, None], np.clip(v + 127, 0, 254)].astype(np.float64)
    has_symbol = (np.abs(v) <= 127) & (f > 0)
    escape = freqs[classes, rans.ESCAPE].astype(np.float64)[:, None]
    bits = np.where(has_symbol, np.log2(4096 / np.where(has_symbol, f, 1)), np.log2(4096 / escape) + 16)
    return float(bits.sum()) / 8


@pytest.mark.parametrize("seed", range(3))
def test_the_stream_is_within_half_a_percent_of_the_cross_entropy(seed):
    rng = np.random.default_rng(100 + seed)
    tables = random_tables(rng, 16)
    values = random_values(rng, 200, 1000)
    classes = rng.integers(0, 16, 200).astype(np.int32)
    data = rans.encode(values, classes, tables)
    ideal = cross_entropy_bytes(values, classes, tables.freqs)
    assert abs(len(data) - ideal) <= 0.005 * ideal + 16, (len(data), ideal)


# -- the document, followed literally --------------------------------------------------------

BYTE_TABLE = [16] * 256  # an escaped value's bytes: "frequency 16 and start 16·b"


def reference_decode(data: bytes, classes, n: int, freqs) -> list[list[int]]:
    """docs/formats.md, "Entropy-coded symbol rows (rANS)", one sentence at a time, in plain Python."""
    L = 1 << 16
    if len(data) < 8 or len(data) % 2:
        raise CorruptData("fewer than 8 bytes or an odd length")
    states = [int.from_bytes(data[0:4], "little"), int.from_bytes(data[4:8], "little")]
    words = [int.from_bytes(data[j : j + 2], "little") for j in range(8, len(data), 2)]
    if min(states) < L:
        raise CorruptData("a starting state below L")
    read = 0
    i = 0  # the position in the symbol sequence

    def symbol(f) -> int:
        nonlocal read, i
        start = [sum(f[:s]) for s in range(256)]
        x = states[i & 1]
        slot = x % 4096
        s = next(s for s in range(256) if start[s] <= slot < start[s] + f[s])
        x = f[s] * (x >> 12) + slot - start[s]
        if x < L:
            if read == len(words):
                raise CorruptData("a word read past the end")
            x = (x << 16) | words[read]
            read += 1
        states[i & 1] = x
        i += 1
        return s

    rows = []
    for c in classes:
        f = [int(e) for e in freqs[c]]
        row = []
        for _ in range(n):
            s = symbol(f)
            if s != 255:
                row.append(s - 127)
                continue
            u = symbol(BYTE_TABLE) | symbol(BYTE_TABLE) << 8
            v = u - 32768
            if abs(v) <= 127 and f[v + 127] > 0:
                raise CorruptData("an escape of a value that has a symbol")
            row.append(v)
        rows.append(row)
    if states != [L, L] or read != len(words):
        raise CorruptData("the states did not end at L, or words were left")
    return rows


def test_a_decoder_written_from_the_document_reads_what_the_c_encoder_writes():
    rng = np.random.default_rng(5)
    tables = random_tables(rng, 5)
    values = random_values(rng, 7, 60)
    classes = rng.integers(0, 5, 7).astype(np.int32)
    data = rans.encode(values, classes, tables)
    assert reference_decode(data, classes, 60, tables.freqs) == values.tolist()
    assert (
        reference_decode(rans.encode(values[:, :1], classes, tables), classes, 1, tables.freqs)
        == values[:, :1].tolist()
    )


# -- damage ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream():
    rng = np.random.default_rng(9)
    tables = random_tables(rng, 4)
    values = random_values(rng, 6, 80)
    classes = rng.integers(0, 4, 6).astype(np.int32)
    return rans.encode(values, classes, tables), classes, tables


def test_a_truncated_stream_or_one_with_bytes_added_is_corrupt(stream):
    data, classes, tables = stream
    for bad in (b"", data[:7], data[:8], data[:-1], data[:-2], data[: len(data) // 2], data + b"\0\0"):
        with pytest.raises(CorruptData, match="damaged"):
            rans.decode(bad, classes, 80, tables)


@pytest.mark.parametrize("at", range(8))
def test_a_flipped_byte_in_the_states_is_corrupt(stream, at):
    data, classes, tables = stream
    bad = bytearray(data)
    bad[at] ^= 0x5A
    with pytest.raises(CorruptData):
        rans.decode(bytes(bad), classes, 80, tables)
    with pytest.raises(CorruptData):
        reference_decode(bytes(bad), classes, 80, tables.freqs)


def test_the_wrong_tables_classes_or_length_are_corrupt(stream):
    data, classes, tables = stream
    for args in (
        (data, classes[::-1].copy(), 80, tables),
        (data, classes, 79, tables),
        (data, classes[:-1], 80, tables),
    ):
        with pytest.raises(CorruptData):
            rans.decode(*args)


def test_garbage_decodes_to_an_error_never_a_crash():
    rng = np.random.default_rng(13)
    tables = random_tables(rng, 3)
    classes = np.array([0, 1, 2, 0], np.int32)
    recon = np.zeros((3, 256), np.float32)
    out = np.empty((4, 500), np.float32)
    for length in [*range(0, 40), 100, 1000, 4000]:
        garbage = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        with pytest.raises(CorruptData):
            rans.decode(garbage, classes, 500, tables)
        with pytest.raises(CorruptData):
            rans.decode_into(garbage, classes, 500, tables, recon, 1.0, out)


# -- tables ----------------------------------------------------------------------------------


def test_frequencies_sum_to_4096_and_keep_every_counted_symbol_and_escape():
    rng = np.random.default_rng(17)
    counts = rng.integers(0, 1000, (20, 256)) * (rng.random((20, 256)) < 0.3)
    counts[0, 0] = 10**9  # one symbol dwarfs the rest, which must still code
    counts[1] = 0  # no counts at all: a flat table
    f = rans.frequencies(counts).astype(np.int64)
    assert f.dtype == np.int64 and (f.sum(axis=1) == 4096).all()
    counted = np.delete(counts, 1, axis=0) > 0
    assert ((np.delete(f, 1, axis=0) > 0) == (counted | (np.arange(256) == 255))).all()
    assert (f[1] == 16).all() and f[0, 0] > 3800
    rows = np.arange(2, 20)
    share = counts[rows] / counts[rows].sum(axis=1, keepdims=True)
    assert np.abs(f[rows] / 4096 - share).max() < 256 / 4096  # proportional, but for the floors of 1


def test_frequencies_break_ties_to_the_lower_symbol():
    counts = np.zeros((1, 256), np.int64)
    counts[0, 10:16] = 5  # 6 symbols and ESCAPE get 1 each, then 4089 = 6 · 681 + 3 left over
    f = rans.frequencies(counts)[0]
    assert f[10:13].tolist() == [683, 683, 683] and f[13:16].tolist() == [682, 682, 682] and f[255] == 1
    assert f.sum() == 4096


def test_tables_precompute_starts_and_the_slot_of_every_symbol():
    f = rans.frequencies(np.random.default_rng(19).integers(0, 50, (3, 256)))
    tables = rans.Tables(f)
    assert tables.starts[:, 0].tolist() == [0, 0, 0] and (tables.starts[:, 1:] == np.cumsum(f, axis=1)[:, :-1]).all()
    for k in range(3):
        assert np.bincount(tables.slots[k], minlength=256).tolist() == f[k].tolist()
        assert (np.diff(tables.slots[k].astype(np.int64)) >= 0).all()
    with pytest.raises(ValueError):
        tables.freqs[0, 0] = 1  # shared by threads: read-only


@pytest.mark.parametrize(
    "freqs, match",
    [
        (np.full((2, 255), 16), "classes, 256"),
        (np.zeros((0, 256), np.int64), "classes, 256"),
        (np.full((1, 256), 16.0), "integers"),
        (np.full((1, 256), 15), "sums to 3840"),
        (
            dominant_table(3)[None] + np.eye(1, 256, 255, dtype=np.int64) * -1 + np.eye(1, 256, 3, dtype=np.int64),
            "ESCAPE",
        ),
    ],
)
def test_bad_tables_are_refused(freqs, match):
    with pytest.raises(InvalidArgument, match=match):
        rans.Tables(freqs)


def test_bad_arguments_are_refused_with_what_to_fix():
    tables = rans.Tables(np.stack([dominant_table(127)] * 2))
    values = np.zeros((3, 4), np.int16)
    data = rans.encode(values, np.zeros(3, np.int32), tables)
    cases = [
        (lambda: rans.encode(values, np.array([0, 1, 2], np.int32), tables), "0 .. 1"),
        (lambda: rans.encode(values, np.array([0, -1, 0], np.int32), tables), "0 .. 1"),
        (lambda: rans.encode(values, np.zeros(2, np.int32), tables), "one class per row"),
        (lambda: rans.encode(values[0], np.zeros(3, np.int32), tables), "2-D"),
        (lambda: rans.encode(np.full((3, 4), 40000), np.zeros(3, np.int32), tables), "int16"),
        (lambda: rans.decode(data, np.zeros(3, np.int32), 4, tables, used=5), "used"),
        (lambda: rans.frequencies(np.ones((2, 256), np.float32)), "integers"),
        (lambda: rans.frequencies(-np.ones((2, 256), np.int64)), "0 .. 2"),
    ]
    recon = np.zeros((2, 256), np.float32)
    out = np.zeros((3, 8), np.float32)
    cases += [
        (lambda: rans.decode_into(data, np.zeros(3, np.int32), 4, tables, recon[:1], 1.0, out[:, :4]), "recon"),
        (
            lambda: rans.decode_into(data, np.zeros(3, np.int32), 4, tables, recon, 1.0, out[:, ::2]),
            "unit column stride",
        ),
        (
            lambda: rans.decode_into(data, np.zeros(3, np.int32), 4, tables, recon, 1.0, out[:, :4].astype(np.float64)),
            "float32",
        ),
        (lambda: rans.decode_into(data, np.zeros(2, np.int32), 4, tables, recon, 1.0, out[:, :4]), "rows"),
        (lambda: rans.decode_into(data, np.zeros(3, np.int32), 4, tables, recon, 1.0, out[:, :5]), "used"),
    ]
    for call, match in cases:
        with pytest.raises(InvalidArgument, match=match):
            call()


def test_without_the_built_module_importing_works_and_coding_says_to_reinstall():
    code = (
        "import sys; sys.modules['kvdb.codecs._rans'] = None\n"
        "import numpy as np\n"
        "from kvdb.codecs import rans\n"
        "from kvdb.errors import InvalidArgument\n"
        "assert not rans.available()\n"
        "tables = rans.Tables(rans.frequencies(np.ones((1, 256), np.int64)))\n"
        "try:\n"
        "    rans.encode(np.zeros((1, 1), np.int16), np.zeros(1, np.int32), tables)\n"
        "except InvalidArgument as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "reinstall kvdb with a C compiler" in done.stdout
