"""Hostile input: the transcript parsers and every decoder of stored bytes answer garbage with
their typed error (TranscriptError, CorruptData, InvalidArgument), never anything else."""

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import examples

from kvdb import transcripts
from kvdb.codecs import fractal, quant
from kvdb.errors import CorruptData, InvalidArgument, KvdbError, TranscriptError
from kvdb.index.walk import WalkIndex
from kvdb.model import lmcode

FUZZ = settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "from", "value", "messages", "conversations", "id", "name", "x"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from(transcripts.SUPPORTED_SUFFIXES))
def test_parsers_on_random_bytes(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"t{suffix}"
    path.write_bytes(data)
    try:
        for t in transcripts.read_transcripts(path):
            assert (t.text is None) != (t.messages is None)
    except TranscriptError as exc:
        assert str(path) in str(exc)


@FUZZ
@given(value=json_values, suffix=st.sampled_from([".json", ".jsonl"]))
def test_parsers_on_wrong_shapes(tmp_path_factory, value, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"t{suffix}"
    path.write_text(json.dumps(value) + ("\n" if suffix == ".jsonl" else ""), encoding="utf-8")
    try:
        for t in transcripts.read_transcripts(path):
            assert all(isinstance(m["content"], str) for m in t.messages or ())
    except TranscriptError:
        pass


@FUZZ
@given(data=st.binary(max_size=300), alphabet=st.sampled_from([2, 256, 1024, 49152, fractal.MAX_ALPHABET]))
def test_fractal_block_decoder_on_garbage(data, alphabet):
    try:
        fractal.decode_block(data, alphabet)
    except (CorruptData, InvalidArgument):
        pass


@FUZZ
@given(data=st.binary(max_size=300))
def test_stored_blob_readers_on_garbage(tmp_path_factory, data):
    for read in (lmcode.read_header, quant.Codebooks.from_bytes):
        try:
            read(data)
        except KvdbError:
            pass
    path = tmp_path_factory.mktemp("fuzz") / "x.keys"
    path.write_bytes(data)
    try:
        WalkIndex.load(path)
    except KvdbError:
        pass


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 4))
def test_damaged_real_blobs_are_refused(seed, flips):
    rng = np.random.default_rng(seed)
    [blob] = fractal.encode_blocks(rng.integers(0, 49152, 300), 49152)
    books = quant.train(
        {
            "k": rng.normal(size=(1, 1, 300, 4)).astype(np.float32),
            "v": rng.normal(size=(1, 1, 300, 4)).astype(np.float32),
        },
        "k1v1",
        niter=1,
    )
    for good, read in (
        (blob, lambda b: fractal.decode_block(b, 49152)),
        (books.to_bytes(), quant.Codebooks.from_bytes),
    ):
        damaged = bytearray(good)
        for at in rng.integers(0, len(damaged), flips):
            damaged[at] ^= 1 << int(rng.integers(0, 8))
        if bytes(damaged) == good:
            continue
        try:
            read(bytes(damaged))
            raise AssertionError("a damaged blob decoded")
        except (CorruptData, InvalidArgument):
            pass
