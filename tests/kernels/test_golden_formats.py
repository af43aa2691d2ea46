"""Golden bytes: every byte format kvdb writes is exactly what kvdb 0.1.0 wrote, and reads back.

The files under tests/fixtures/golden were written by ``make_golden.py`` there, from the fixed
inputs it defines (imported here, so inputs are stated once). For each format, one test
encodes those inputs again and compares bytes with the committed files; another decodes the
committed files and compares with the inputs. A refactor must pass both without touching
the files; a deliberate format change bumps the format's version and regenerates them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from kvdb.codecs import code_layout, fractal, quant, rans
from kvdb.index.walk import WalkIndex
from kvdb.migrations import _frozen_0002_fractal as frozen
from kvdb.model import capture, lmcode
from kvdb.model.prefix_cache import PrefixCache

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def assert_golden(files: dict[str, bytes]) -> None:
    """Each generated file has exactly the bytes of its committed twin."""
    for name, data in sorted(files.items()):
        path = GOLDEN / name
        assert path.is_file(), f"{name} is generated but not committed under {GOLDEN}"
        stored = path.read_bytes()
        if data != stored:
            at = next((i for i, (a, b) in enumerate(zip(data, stored)) if a != b), min(len(data), len(stored)))
            pytest.fail(
                f"{name}: the code now writes {len(data)} bytes where kvdb 0.1.0 wrote {len(stored)}; "
                f"they first differ at byte {at} (now {data[at : at + 8].hex()}, golden {stored[at : at + 8].hex()}). "
                "A format change needs a new format version, not new golden files."
            )


def blocks(folder: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((GOLDEN / folder).glob("*.bin"))]


@pytest.fixture
def prefix_budget(monkeypatch):
    monkeypatch.setenv("KVDB_PREFIX_CACHE_MB", str(1024))  # the default: the prefix cache is on


def test_the_golden_folder_holds_exactly_the_generated_files(tmp_path, prefix_budget):
    generated = (
        golden.fractal_files()
        | golden.kl_files()
        | golden.kl_node_files()
        | golden.quant_files()
        | golden.transform_files()
        | golden.entropy_coded_files()
        | golden.rans_files()
        | golden.index_files(tmp_path)
        | golden.prefix_files(tmp_path)
    )
    committed = {
        p.relative_to(GOLDEN).as_posix()
        for p in GOLDEN.rglob("*")
        if p.is_file() and p.suffix in (".bin", ".keys", ".tail", ".kv")
    }
    kept = {
        f"kl/{case[0]}.bin" for case in (golden.MODEL_CASE, golden.V2_CASE, golden.V3_CASE, golden.MODEL_NODE_CASE)
    } | {golden.PREFIX_V1, *golden.INDEX_V3, *golden.INDEX_V4, *golden.INDEX_V5, *golden.INDEX_V6}
    assert committed == set(generated) | kept


# -- fractal token blocks (format tag 0xF1) -------------------------------------------------


def test_fractal_blocks_encode_to_the_golden_bytes():
    assert_golden(golden.fractal_files())


@pytest.mark.parametrize(("alphabet", "block_size", "n"), golden.FRACTAL_CASES)
def test_golden_fractal_blocks_decode_to_their_symbols(alphabet, block_size, n):
    blobs = blocks(golden.fractal_dir(alphabet, block_size, n))
    expected = golden.symbols(n, alphabet)
    assert len(blobs) == -(-n // block_size)
    assert [fractal.block_count(b, alphabet) for b in blobs] == [
        min(block_size, n - k * block_size) for k in range(len(blobs))
    ]
    np.testing.assert_array_equal(fractal.decode_blocks(blobs, alphabet), expected)
    lo, hi = (
        max(0, min(block_size, n) - 3),
        min(n, block_size + 2),
    )  # across the first block boundary, where there is one
    needed = fractal.blocks_for_range(lo, hi, block_size)
    np.testing.assert_array_equal(
        fractal.decode_range(blobs[needed.start : needed.stop], alphabet, block_size, lo, hi), expected[lo:hi]
    )


@pytest.mark.parametrize("alphabet", [2, 259, 65537])
def test_an_empty_stream_is_no_blocks(alphabet):
    assert fractal.encode_blocks(np.zeros(0, np.int64), alphabet) == []
    assert fractal.decode_blocks([], alphabet).size == 0


# -- what the old migrations write: the frozen codec of 0002 and 0004 -----------------------


@pytest.mark.parametrize(("alphabet", "block_size", "n"), golden.FRACTAL_CASES)
def test_the_frozen_migration_codec_writes_and_reads_the_golden_blocks(alphabet, block_size, n):
    folder = golden.fractal_dir(alphabet, block_size, n)
    expected = golden.symbols(n, alphabet)
    assert frozen.encode_blocks(expected, alphabet, block_size) == blocks(folder)
    np.testing.assert_array_equal(frozen.decode_blocks(blocks(folder), alphabet), expected)
    assert frozen.decode_block(blocks(folder)[0], alphabet, 0, 1).tolist() == [expected[0]]  # what 0004 reads


@pytest.mark.parametrize("alphabet", [259, 49152, 65537])
def test_the_frozen_migration_codec_is_todays_kvdb_fractal(alphabet):
    """Format 1 today. When kvdb.codecs.fractal writes a new format this fails, on purpose: the frozen
    copy keeps writing format 1 for migration 0002, and this comparison is then dropped."""
    stream = golden.symbols(3 * fractal.DEFAULT_BLOCK + 5, alphabet, salt=9)
    assert (frozen.FORMAT_TAG, frozen.DEFAULT_BLOCK, frozen.MIN_ALPHABET) == (
        fractal.FORMAT_TAG,
        fractal.DEFAULT_BLOCK,
        fractal.MIN_ALPHABET,
    )
    assert frozen.encode_blocks(stream, alphabet, frozen.DEFAULT_BLOCK) == fractal.encode_blocks(
        stream, alphabet, fractal.DEFAULT_BLOCK
    )


def test_migrations_do_not_import_kvdb():
    folder = Path(frozen.__file__).parent
    for path in [frozen.__file__, *sorted((folder / "versions").glob("*.py"))]:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        live = [m for m in imported if m.split(".")[0] == "kvdb" and not m.startswith("kvdb.migrations")]
        assert not live, f"{path} imports the live kvdb: freeze what it needs"


# -- tier L payloads ("KL" version 1) -------------------------------------------------------


def varint_length(value: int) -> int:
    return max(1, -(-value.bit_length() // 7))


def check_kl(payload: bytes, model, vocab: int, context: int, n: int, version: int = 1) -> None:
    """The payload's header says what was coded, and it decodes to the tokens."""
    before, ids = golden.kl_inputs(vocab, context, n)
    header = lmcode.read_header(payload)
    assert payload[:3] == b"KL" + bytes([version])
    assert (header.version, header.vocab, header.context_len, header.n_tokens) == (version, vocab, context, n)
    assert header.digest == golden.token_digest(ids)
    assert header.size == 3 + sum(varint_length(v) for v in (vocab, context, n)) + 8 + 4
    assert (len(payload) - header.size) % 4 == 0
    decoded, after = lmcode.decode(
        model, payload, context=lmcode.context_for(model, before, version=version) if context else None
    )
    np.testing.assert_array_equal(decoded, ids)
    assert after.length == context + n


def test_kl_payloads_encode_to_the_golden_bytes():
    assert_golden(golden.kl_files())


@pytest.mark.parametrize(("name", "vocab", "context", "n"), golden.KL_CASES)
def test_golden_kl_payloads_read_back(name, vocab, context, n):
    check_kl((GOLDEN / f"kl/{name}.bin").read_bytes(), golden.TableModel(vocab), vocab, context, n)


def require_golden_frequencies(model, case, version: int) -> None:
    """Skip, saying why, where this CPU derives other coding frequencies for ``case`` than the
    machine that wrote its golden file: its bytes cannot be written here, by design of its version."""
    if golden.frequency_digest(model, *case[1:], version=version) != golden.FREQUENCIES_AS_GOLDEN[case[0]]:
        pytest.skip(
            "premise does not hold on this CPU: its float kernels give the committed model other coding frequencies "
            f"for kl/{case[0]}.bin than the machine that wrote it "
            f"(payload version {version} is not portable; version 3 is checked on every machine)"
        )


def test_kl_payload_of_the_committed_tiny_model():
    """Machine-dependent: the payload follows the model's one-token forward pass, which is
    bit-exact only on CPU kernels that compute it as the machine that wrote the golden file did
    (see kvdb/model/lmcode.py). The table-model payloads above are the machine-independent check."""
    name, vocab, context, n = golden.MODEL_CASE
    model = golden.load_committed_model()
    require_golden_frequencies(model, golden.MODEL_CASE, 1)
    assert_golden(golden.kl_model_files())
    check_kl((GOLDEN / f"kl/{name}.bin").read_bytes(), model, vocab, context, n)


def test_the_version_3_payload_is_the_same_bytes_on_every_machine():
    """Version 3 codes against kvdb.model.integer_lm, whose results depend on the weights and tokens
    alone: the committed tiny model's payload is written and read back byte for byte here,
    whatever this CPU (tests/kernels/test_integer_lm.py checks other instruction sets)."""
    name, vocab, context, n = golden.V3_CASE
    assert_golden(golden.kl_integer_files(golden.V3_CASE, 3))
    check_kl((GOLDEN / f"kl/{name}.bin").read_bytes(), golden.load_committed_model(), vocab, context, n, version=3)


def test_a_version_2_payload_still_reads_and_writes_the_same_bytes():
    """Version 2 (the integer pass with torch.sqrt, written before version 3) is still read, by
    the reference pass, and that pass still writes the committed bytes where torch.sqrt gives the
    coder the frequencies it gave on the machine that wrote them."""
    name, vocab, context, n = golden.V2_CASE
    model = golden.load_committed_model()
    require_golden_frequencies(model, golden.V2_CASE, 2)
    assert_golden(golden.kl_integer_files(golden.V2_CASE, 2))
    check_kl((GOLDEN / f"kl/{name}.bin").read_bytes(), model, vocab, context, n, version=2)


def check_node(payload: bytes, model, vocab: int, context: int, n: int, version: int) -> None:
    """A node payload: its tag, and the tokens it decodes to given the context."""
    before, ids = golden.kl_inputs(vocab, context, n)
    assert payload[0] == lmcode.NODE_TAG | version
    decoded, after = lmcode.decode_node(
        model, payload, n, context=lmcode.context_for(model, before, version=version) if context else None
    )
    np.testing.assert_array_equal(decoded, ids)
    assert after.length == context + n


def test_node_payloads_are_the_same_bytes_on_every_machine():
    """Trie-node payloads (tag byte, kvdb.codecs.rangecoder's stream): the table model's at version 1
    and the committed tiny model's at version 3, written and read back byte for byte."""
    assert_golden(golden.kl_node_files() | golden.kl_model_node_files())
    name, vocab, context, n = golden.NODE_CASE
    check_node((GOLDEN / f"kl/{name}.bin").read_bytes(), golden.TableModel(vocab), vocab, context, n, 1)
    name, vocab, context, n = golden.MODEL_NODE_CASE
    check_node((GOLDEN / f"kl/{name}.bin").read_bytes(), golden.load_committed_model(), vocab, context, n, 3)


# -- KV codebooks and code streams ----------------------------------------------------------


def test_codebooks_and_code_streams_encode_to_the_golden_bytes():
    assert_golden(golden.quant_files())


def test_entropy_coded_codebooks_and_payload_encode_to_the_golden_bytes_and_decode_from_them():
    from kvdb.codecs import entropy_coded

    assert_golden(golden.entropy_coded_files())
    read = code_layout.read_codebooks((GOLDEN / "entropy_coded" / "codebooks.bin").read_bytes())
    assert (
        isinstance(read, entropy_coded.EntropyCodebooks)
        and read.to_bytes() == golden.entropy_coded_codebooks().to_bytes()
    )
    streams = {entropy_coded.PAYLOAD: np.frombuffer((GOLDEN / "entropy_coded" / "payload.bin").read_bytes(), np.uint8)}
    codes = code_layout.codes_from_streams(read, streams, golden.SEQ)
    for a, b in zip(codes, golden.entropy_coded_codes()):
        assert np.array_equal(a, b)
    keys, values = read.decode(codes)
    # docs/formats.md: y = recon[class][q + 127] for a symbol the class's table codes, else q * step;
    # x = y @ (basis^T diag(1 / weights)) + centre
    q = codes[1][1, 0].astype(np.int64)  # layer 1, head 0's values: [dim, seq]
    classes = read.classes["v"][1, 0][:, None]
    coded = (np.abs(q) <= 127) & (read.freqs[classes, np.clip(q + 127, 0, 255)] > 0)
    y = np.where(coded, read.recon[classes, np.clip(q + 127, 0, 255)], q * read.step).T.astype(np.float32)
    expected = y @ (read.basis["v"][1, 0].T / read.weights["v"][1, 0][None, :]) + read.centre["v"][1, 0]
    scale = 1e-5 * float(
        np.abs(expected).max()
    )  # the escaped int16 extremes make some values thousands: float32 sums round there
    np.testing.assert_allclose(values[1, 0], expected, rtol=0, atol=scale)
    for layer, (k, v) in enumerate(code_layout.decode_streams(read, streams, golden.SEQ)):
        np.testing.assert_allclose(k, keys[layer], rtol=0, atol=scale)
        np.testing.assert_allclose(v, values[layer], rtol=0, atol=scale)


@pytest.mark.parametrize(
    "name, version, inputs",
    [("predicted_codebooks", 2, 2), ("predicted_from_fewer_codebooks", 3, 1)],
    ids=["version 2: as many inputs as predicted", "version 3: fewer inputs"],
)
def test_predicted_entropy_coded_codebooks_decode_the_golden_payload_with_their_prediction(name, version, inputs):
    from kvdb.codecs import entropy_coded

    blob = (GOLDEN / "entropy_coded" / f"{name}.bin").read_bytes()
    read = code_layout.read_codebooks(blob)
    made = {2: golden.entropy_coded_predicted_codebooks, 3: golden.entropy_coded_predicted_from_fewer_codebooks}[
        version
    ]()
    assert isinstance(read, entropy_coded.EntropyCodebooks) and read.to_bytes() == made.to_bytes()
    assert int.from_bytes(blob[8:12], "little") == version and read.predicted == 2 and read.prediction_inputs == inputs
    plain = code_layout.read_codebooks((GOLDEN / "entropy_coded" / "codebooks.bin").read_bytes())
    streams = {entropy_coded.PAYLOAD: np.frombuffer((GOLDEN / "entropy_coded" / "payload.bin").read_bytes(), np.uint8)}
    codes = code_layout.codes_from_streams(read, streams, golden.SEQ)  # the integers are laid out as without prediction
    # docs/formats.md: layer 1's predicted rows (kind > head > each head's first 2 coefficients) gain
    # predictor[1] @ layer 0's input rows (each head's first `inputs`), decoded
    coefficients = {}
    for key, books in (("plain", plain), ("predicted", read)):
        keys, values = books.decode(codes)
        coefficients[key] = np.stack(
            [
                np.einsum("lhnd,lhde->lhen", x - books.centre[kind][:, :, None], books.encoder(kind))
                for kind, x in zip(entropy_coded.KINDS, (keys, values))
            ],
            1,
        ).reshape(golden.LAYERS, -1, golden.SEQ)
    rows = (np.arange(2 * golden.HEADS)[:, None] * golden.DIM + np.arange(2)).reshape(-1)
    fed = (np.arange(2 * golden.HEADS)[:, None] * golden.DIM + np.arange(inputs)).reshape(-1)
    expected = coefficients["plain"].copy()
    expected[1, rows] += read.predictor[1] @ coefficients["plain"][0, fed]
    np.testing.assert_allclose(coefficients["predicted"], expected, rtol=0, atol=1e-3 * float(np.abs(expected).max()))
    keys, values = read.decode(codes)
    for layer, (k, v) in enumerate(code_layout.decode_streams(read, streams, golden.SEQ)):
        np.testing.assert_allclose(k, keys[layer], rtol=0, atol=1e-5 * float(np.abs(keys).max()))
        np.testing.assert_allclose(v, values[layer], rtol=0, atol=1e-5 * float(np.abs(values).max()))


def test_joint_entropy_coded_codebooks_are_version_4_and_decode_the_golden_payload_with_their_rotation():
    from kvdb.codecs import entropy_coded

    blob = (GOLDEN / "entropy_coded" / "joint_codebooks.bin").read_bytes()
    read = code_layout.read_codebooks(blob)
    assert (
        isinstance(read, entropy_coded.EntropyCodebooks)
        and read.to_bytes() == golden.entropy_coded_joint_codebooks().to_bytes()
    )
    assert (
        int.from_bytes(blob[8:12], "little") == 4 and read.joint and read.predicted == 2 and read.prediction_inputs == 1
    )
    streams = {entropy_coded.PAYLOAD: np.frombuffer((GOLDEN / "entropy_coded" / "payload.bin").read_bytes(), np.uint8)}
    codes = code_layout.codes_from_streams(
        read, streams, golden.SEQ
    )  # the integers are laid out as any set's: a layer's rows in order
    rows = 2 * golden.HEADS * golden.DIM
    q = np.stack(codes, 1).reshape(golden.LAYERS, rows, golden.SEQ)
    # docs/formats.md: y = recon[class][q + 127] (an escape: q * step);
    # layer 1's first 2 rows gain predictor[1] @ layer 0's first row;
    # x (kind > head > dim) = y @ basis^-1 / weights + centre,
    # the basis a signed permutation here (its inverse its transpose)
    classes = np.broadcast_to(read.classes[entropy_coded.JOINT][..., None], q.shape)
    symbol = np.clip(q.astype(np.int64) + 127, 0, 254)
    coded = (np.abs(q) <= 127) & (read.freqs[classes, symbol] > 0)  # else an escape: q * step
    y = np.where(coded, read.recon[classes, symbol], q * read.step).astype(np.float64)
    y[1, :2] += read.predictor[1] @ y[0, :1]
    weights = np.concatenate([read.weights[kind].reshape(golden.LAYERS, -1) for kind in entropy_coded.KINDS], 1)
    centre = np.concatenate([read.centre[kind].reshape(golden.LAYERS, -1) for kind in entropy_coded.KINDS], 1)
    x = (
        np.matmul(y.swapaxes(1, 2), read.basis[entropy_coded.JOINT].swapaxes(1, 2)) / weights[:, None] + centre[:, None]
    ).reshape(golden.LAYERS, golden.SEQ, 2, golden.HEADS, golden.DIM)
    keys, values = read.decode(codes)
    scale = 1e-6 * float(np.abs(x).max())  # float32 of values up to 32767 steps (escapes)
    np.testing.assert_allclose(keys, x[:, :, 0].transpose(0, 2, 1, 3), rtol=0, atol=scale)
    np.testing.assert_allclose(values, x[:, :, 1].transpose(0, 2, 1, 3), rtol=0, atol=scale)
    for layer, (k, v) in enumerate(code_layout.decode_streams(read, streams, golden.SEQ)):
        np.testing.assert_allclose(k, keys[layer], rtol=0, atol=scale)
        np.testing.assert_allclose(v, values[layer], rtol=0, atol=scale)


def test_transform_codebooks_and_streams_encode_to_the_golden_bytes_and_decode_from_them():
    assert_golden(golden.transform_files())
    read = code_layout.read_codebooks((GOLDEN / "transform" / "codebooks.bin").read_bytes())
    made = golden.transform_codebooks()
    assert read.to_bytes() == made.to_bytes() and read.bits_per_element() == made.bits_per_element()
    streams = {
        int(folder.name[1:]): fractal.decode_blocks(blocks(f"transform/streams/{folder.name}"), int(folder.name[1:]))
        for folder in sorted((GOLDEN / "transform" / "streams").iterdir())
    }
    codes = code_layout.codes_from_streams(read, streams, golden.SEQ)
    for a, b in zip(codes, golden.transform_codes()):
        assert np.array_equal(a, b)
    keys, values = read.decode(codes)
    # docs/formats.md: x = y @ (basis^T diag(1 / weights)) + centre,
    # y the levels of the coded coefficients, 0 for the others
    y = np.zeros((golden.SEQ, golden.DIM), np.float32)
    for d, bits in enumerate(golden.TRANSFORM_BITS["v"][1][0]):  # layer 1, head 0's values
        start = sum(
            1 << b for b in np.array(golden.TRANSFORM_BITS["v"]).reshape(-1)[: golden.HEADS * golden.DIM + d] if b
        )
        y[:, d] = read.levels["v"][start + codes[1][1, 0, d]] if bits else 0
    expected = y @ (read.basis["v"][1, 0].T / read.weights["v"][1, 0][None, :]) + read.centre["v"][1, 0]
    np.testing.assert_allclose(values[1, 0], expected, rtol=1e-6, atol=1e-6)
    for layer, (k, v) in enumerate(code_layout.decode_streams(read, streams, golden.SEQ)):
        np.testing.assert_allclose(k, keys[layer], atol=1e-6)
        np.testing.assert_allclose(v, values[layer], atol=1e-6)


def test_rans_rows_encode_to_the_golden_bytes_and_decode_from_them():
    assert_golden(golden.rans_files())
    tables = rans.Tables(golden.rans_freqs())
    for name, rows, n in golden.RANS_CASES:
        values, classes = golden.rans_inputs(rows, n)
        data = (GOLDEN / "rans" / f"{name}.bin").read_bytes()
        np.testing.assert_array_equal(rans.decode(data, classes, n, tables), values)
    values, classes = (a.astype(np.int64) for a in golden.rans_inputs(7, 9))
    assert (
        (np.abs(values) > 127) | (tables.freqs[classes[:, None], np.clip(values + 127, 0, 254)] == 0)
    ).sum() >= 10  # escapes of both kinds are in the bytes
    assert ((np.abs(values) <= 127) & (tables.freqs[classes[:, None], np.clip(values + 127, 0, 254)] == 0)).any()


@pytest.mark.parametrize(
    "name, weights, per_head",
    [("codebooks.bin", True, False), ("codebooks_no_weights.bin", False, False), ("codebooks_v2.bin", True, True)],
)
def test_golden_codebooks_read_back(name, weights, per_head):
    read, made = quant.Codebooks.from_bytes((GOLDEN / "quant" / name).read_bytes()), golden.codebooks(weights, per_head)
    assert (read.layers, read.heads, read.dim, read.pre_rope, read.preset, read.meta) == (
        made.layers,
        made.heads,
        made.dim,
        made.pre_rope,
        made.preset,
        made.meta,
    )
    for kind in quant.KINDS:
        assert read.stages(kind) == golden.STAGES[kind]
        assert read.depth(kind).tolist() == (
            golden.DEPTHS[kind] if per_head else [[len(s)] * golden.HEADS for s in golden.STAGES[kind]]
        )
        for layer_read, layer_made in zip(read.books[kind], made.books[kind], strict=True):
            for a, b in zip(layer_read, layer_made, strict=True):
                np.testing.assert_array_equal(a, b)
    assert sorted(read.weights) == sorted(made.weights)
    for kind, scales in made.weights.items():
        np.testing.assert_array_equal(read.weights[kind], scales)


@pytest.mark.parametrize("folder, per_head", [("streams", False), ("streams_v2", True)])
def test_golden_code_streams_read_back(folder, per_head):
    books = golden.codebooks(per_head=per_head)
    sizes = sorted({size for kind in quant.KINDS for sizes in golden.STAGES[kind] for size in sizes})
    streams = {size: fractal.decode_blocks(blocks(f"quant/{folder}/a{size}"), size) for size in sizes}
    for ours, theirs in zip(
        code_layout.codes_from_streams(books, streams, golden.SEQ), golden.codes(per_head), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)


# -- the search sidecar ("KVDBIDX7"; "KVDBIDX6" read; "KVDBIDX3" to "KVDBIDX5" rebuilt:
#    tests/services/test_search.py) --

_PREFIX = struct.Struct("<8s I")  # magic, JSON header length


def test_search_sidecar_writes_the_golden_bytes(tmp_path):
    files = golden.index_files(tmp_path)
    for name, data in files.items():  # the header is JSON: a changed key order or spacing is a changed format
        stored = (GOLDEN / name).read_bytes()
        magic, length = _PREFIX.unpack_from(stored)
        assert data[: _PREFIX.size + length] == stored[: _PREFIX.size + length], (
            f"{name}: header {data[_PREFIX.size :][:length]!r} "
            f"differs from the golden {stored[_PREFIX.size :][:length]!r}"
        )
    assert_golden(files)


@pytest.mark.parametrize("version", [6, 7])  # 6: before the sidecar module (kvdb/index/sidecar.py), still read
@pytest.mark.parametrize(("alphabet", "generation", "first", "second"), golden.INDEX_CASES)
def test_golden_search_sidecar_reads_back(alphabet, generation, first, second, version):
    path = GOLDEN / f"index/v{version}/a{alphabet}.keys"
    index = WalkIndex.load(path, check=True)
    stream = np.concatenate(golden.index_inputs(alphabet, first, second))
    header = WalkIndex.read_header(path)
    assert (header.alphabet, header.ntotal, header.generation) == (alphabet, first + second, generation)
    for segment, entries in ((path, first), (path.with_suffix(".tail"), second)):
        magic, length = _PREFIX.unpack_from(segment.read_bytes())
        header = json.loads(segment.read_bytes()[_PREFIX.size :][:length])
        assert (
            magic == f"KVDBIDX{version}".encode()
            and (header["entries"] if version == 6 else header["arrays"]["order"]["shape"][0]) == entries
        )
    assert (index.alphabet, index.generation, index.ntotal, index.base.ntotal) == (
        alphabet,
        generation,
        first + second,
        first,
    )
    np.testing.assert_array_equal(index.tokens[:], stream)
    for old in (
        f"index/a{alphabet}.keys",
        f"index/v4/a{alphabet}.keys",
        f"index/v5/a{alphabet}.keys",
    ):  # KVDBIDX3 to 5 read as missing: rebuilt
        assert WalkIndex.read_header(GOLDEN / old) is None
    cases = [
        (10, 3),
        (first - 1, min(4, index.depth)),
        (first + 2, index.depth),
        (first + 5, index.depth + 3),
        (first + second - 1, min(index.reach, first + second)),
    ]
    for at, length in cases:  # pieces of one key and of several; the later ones span both nodes
        piece = stream[at - length + 1 : at + 1]
        ends = [p for p in range(length - 1, len(stream)) if np.array_equal(stream[p - length + 1 : p + 1], piece)]
        assert index.within(piece).tolist() == ends


# -- the prefix cache ("KVDBPFX2"; "KVDBPFX1" read) ------------------------------------------


def test_prefix_cache_writes_the_golden_bytes(tmp_path, prefix_budget):
    assert_golden(golden.prefix_files(tmp_path))


@pytest.mark.parametrize(
    "files, key",
    [
        ({golden.PREFIX_V1: golden.PREFIX_KEY}, golden.PREFIX_KEY),  # a whole float32 cache, as kvdb 0.1.0 wrote it
        (
            {f"prefix/{k}.kv": k for k in (golden.PREFIX_KEY, golden.PREFIX_CHILD_KEY)},
            golden.PREFIX_CHILD_KEY,
        ),  # a float16 chain
    ],
)
def test_golden_prefix_cache_entry_reads_back(tmp_path, prefix_budget, files, key):
    folder = PrefixCache(tmp_path / "a.duckdb.prefix")
    folder.folder.mkdir()
    for name, as_key in files.items():
        shutil.copy(GOLDEN / name, folder.path(as_key))  # load() touches the files
    keys, values = golden.prefix_arrays()
    model = golden.TableModel(16, golden.LAYERS, golden.HEADS, golden.DIM)
    assert folder.load(model, [(key, keys.shape[2] + 1)]) is None  # an entry must hold what its node holds
    held, cache = folder.load(model, [("absent", 3), (key, keys.shape[2])])
    assert held == keys.shape[2]
    for ours, theirs in zip(capture.cache_arrays(cache), (keys, values), strict=True):
        np.testing.assert_array_equal(ours, theirs)


# -- codebook headers that do not describe their arrays ------------------------------------


@pytest.mark.parametrize(
    "name", ["quant/codebooks_v2.bin", "transform/codebooks.bin", "entropy_coded/joint_codebooks.bin"]
)
@pytest.mark.parametrize("damage", ["a field gone", "a field of the wrong type"])
def test_a_codebook_header_that_passes_its_crc_but_lacks_a_field_is_corrupt_data(name, damage):
    """Written wrongly, not damaged in transit: the CRC holds, so only the header's reading can tell."""
    from kvdb.codecs import framing
    from kvdb.errors import CorruptData

    blob = (GOLDEN / name).read_bytes()
    magic, version, length = struct.unpack_from("<8sII", blob)
    header = json.loads(blob[16 : 16 + length])
    if damage == "a field gone":
        del header["layers"]
    else:
        header["dim"] = "four"
    reframed = framing.frame(magic, version, header, [blob[16 + length : -4]])
    with pytest.raises(CorruptData, match="codebook blob's header"):
        code_layout.read_codebooks(reframed)
