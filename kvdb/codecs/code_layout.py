"""Tier K's stored layout: a session's codes as one token-major stream per codebook size, and
back; and the restore's decode straight from the streams, layer by layer (docs/formats.md,
"KV code layout in the store"). Tier K codes with residual VQ (``kvdb.codecs.quant``), a
transform coder (``kvdb.codecs.transform``) or an entropy-coded one (``kvdb.codecs.entropy_coded``),
whichever the codebooks are: the functions here take any, and the transform coders lay out their
own streams."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvdb.codecs import entropy_coded, entropy_training, quant, transform
from kvdb.codecs.quant import KINDS, Codebooks
from kvdb.errors import CorruptData, InvalidArgument

KVCodebooks = Codebooks | transform.TransformCodebooks | entropy_coded.EntropyCodebooks


def read_codebooks(blob: bytes) -> KVCodebooks:
    """Codebooks of any coder, by their magic. A blob whose CRC holds but whose header lacks a
    field, or gives one of the wrong type or shape, was written wrongly: it is corrupt data too,
    not a KeyError for the user to decipher."""
    head = bytes(blob[:8])
    readers: dict[bytes, type[KVCodebooks]] = {
        transform.MAGIC: transform.TransformCodebooks,
        entropy_coded.MAGIC: entropy_coded.EntropyCodebooks,
        quant.MAGIC: Codebooks,
    }
    if head not in readers:
        raise CorruptData("not a kvdb codebook blob (bad magic)")
    try:
        return readers[head].from_bytes(blob)
    except KeyError as missing:
        raise CorruptData(
            f"codebook blob's header has no {missing} field; "
            "the blob was written wrongly: train or build the codebooks again"
        ) from None
    except (TypeError, ValueError, AttributeError) as bad:
        raise CorruptData(
            f"codebook blob's header does not describe its arrays ({bad}); train or build the codebooks again"
        ) from None


def train(
    vectors: dict[str, np.ndarray],
    preset: str,
    fisher: dict[str, np.ndarray] | None = None,
    niter: int = 12,
    meta: dict | None = None,
    progress=None,
    threads: int = 1,
) -> KVCodebooks:
    """Codebooks of a preset spec from calibration ``vectors`` (kind -> pre-RoPE ``[layers, heads, n, dim]``):
    a transform preset (``t3``, ``e1.5``) needs the Fisher information of the loss with respect to
    them (``kvdb.model.capture.cache_fisher``); a residual-VQ preset ignores it."""
    if transform.is_transform_preset(preset):
        if fisher is None:
            raise InvalidArgument(
                f"transform preset {preset!r} needs the Fisher information of its calibration vectors"
            )
        if transform.is_entropy_coded(preset):
            return entropy_training.train(vectors, fisher, preset, pre_rope=True, meta=meta)
        return transform.train(vectors, fisher, preset, pre_rope=True, meta=meta)
    return quant.train(vectors, preset, pre_rope=True, niter=niter, meta=meta, progress=progress, threads=threads)


def encode(codebooks: KVCodebooks, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes of float ``[layers, heads, seq, dim]`` keys and values."""
    if not isinstance(codebooks, Codebooks):
        return codebooks.encode(keys, values)
    return quant.encode(codebooks, keys, values)


def decode(codebooks: KVCodebooks, codes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``[layers, heads, seq, dim]`` keys and values of ``encode``'s codes, whole."""
    if not isinstance(codebooks, Codebooks):
        return codebooks.decode(codes)
    return quant.decode(codebooks, codes)


def code_streams(codebooks: KVCodebooks, codes: tuple[np.ndarray, np.ndarray], start: int = 0) -> dict[int, np.ndarray]:
    """The symbols to store, one token-major stream per codebook size: ``{alphabet: symbols}``.

    Token-major (for each position: kind > layer > stage > head) means a session prefix is a
    prefix of each stream, so restore-at-position reads a prefix of blocks and append only
    re-walks the open block. Stages a layer or a head does not have are skipped. ``start``
    drops the first positions (e.g. recomputed sinks).
    """
    if not isinstance(codebooks, Codebooks):
        return codebooks.code_streams(codes, start)
    columns: dict[int, list[np.ndarray]] = {}
    places = _stream_places(codebooks)
    for kind, c in zip(KINDS, codes):
        for layer, stages in enumerate(places[kind]):
            for stage, (size, _, heads) in enumerate(stages):
                columns.setdefault(size, []).append(c[layer, heads, stage, start:])  # [heads, seq]
    return {size: np.concatenate(cols, axis=0).T.reshape(-1).astype(np.int64) for size, cols in columns.items()}


def stream_columns(codebooks: KVCodebooks) -> dict[int, int]:
    """Codes per position in each stream of ``code_streams``: {codebook size: columns}."""
    if not isinstance(codebooks, Codebooks):
        return codebooks.stream_columns()
    columns: dict[int, int] = {}
    for stages in _stream_places(codebooks).values():
        for layer in stages:
            for size, _, heads in layer:
                columns[size] = columns.get(size, 0) + len(heads)
    return columns


def check_streams(codebooks: KVCodebooks, streams: dict[int, np.ndarray], n: int) -> None:
    """Raises CorruptData unless ``streams`` can be the codes of ``n`` positions: symbol streams hold
    ``n`` x columns symbols each; an entropy-coded payload decodes to ``n`` positions."""
    if isinstance(codebooks, entropy_coded.EntropyCodebooks):
        codebooks.codes_from_streams(streams, n)
        return
    expected = {size: n * columns for size, columns in stream_columns(codebooks).items()}
    held = {size: len(symbols) for size, symbols in streams.items()}
    if held != expected:
        raise CorruptData(f"they hold {held} symbols per codebook size, its {n} tokens need {expected}")


def _stream_places(codebooks: Codebooks) -> dict[str, list[list[tuple[int, int, np.ndarray]]]]:
    """Where ``code_streams`` puts each stage: kind -> layer -> stage -> (the stream, i.e. the
    codebook size; the first of the stage's columns there; the heads that take the stage, one
    column each, in order)."""
    columns: dict[int, int] = {}
    places: dict[str, list[list[tuple[int, int, np.ndarray]]]] = {}
    for kind in KINDS:
        places[kind] = []
        depth = codebooks.depth(kind)
        for layer, sizes in enumerate(codebooks.stages(kind)):
            places[kind].append([])
            for stage, size in enumerate(sizes):
                heads = np.flatnonzero(depth[layer] > stage)
                places[kind][-1].append((size, columns.get(size, 0), heads))
                columns[size] = columns.get(size, 0) + len(heads)
    return places


def codes_from_streams(codebooks: KVCodebooks, streams: dict[int, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``code_streams`` (``start=0``): codes ``[layers, heads, stages, n]`` per kind."""
    if not isinstance(codebooks, Codebooks):
        return codebooks.codes_from_streams(streams, n)
    rows = {size: np.asarray(symbols).reshape(n, -1).T for size, symbols in streams.items()}  # [columns, n]
    places = _stream_places(codebooks)
    out = []
    for kind in KINDS:
        codes = np.zeros((codebooks.layers, codebooks.heads, codebooks.max_stages(kind), n), dtype=np.uint16)
        for layer, stages in enumerate(places[kind]):
            for stage, (size, column, heads) in enumerate(stages):
                codes[layer, heads, stage] = rows[size][column : column + len(heads)]
        out.append(codes)
    return out[0], out[1]


def decode_streams(
    codebooks: KVCodebooks, streams: dict[int, np.ndarray], n: int, used: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each layer's ``(keys, values)``, float32 ``[heads, used, dim]``, of the first ``used`` of
    the ``n`` positions whose ``code_streams`` these are, one layer at a time.

    A restore builds the cache layer by layer from this: one layer's gather is a few MB, still in
    the CPU's cache when the caller rotates it, where one gather over every layer writes the
    whole cache to memory and reads it back (decision 0024 has the gather and rotation of the
    keys measured both ways). Each layer's gather is
    one ``embedding_bag`` over all its heads and positions; no code array is built.
    """
    if not isinstance(codebooks, Codebooks):
        return codebooks.decode_streams(streams, n, used)
    return _decode_rvq_streams(codebooks, streams, n, used)


def _decode_rvq_streams(
    codebooks: Codebooks, streams: dict[int, np.ndarray], n: int, used: int | None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    import torch

    used = n if used is None else used
    # [used, columns]: views
    rows = {size: np.asarray(symbols).reshape(n, -1)[:used] for size, symbols in streams.items()}
    places = _stream_places(codebooks)

    def gather(kind: str, layer: int) -> np.ndarray:
        table, offsets = codebooks.gather_table(kind)
        stages = places[kind][layer]
        if not stages or used == 0:
            return np.zeros((codebooks.heads, used, codebooks.dim), np.float32)
        every = all(len(heads) == codebooks.heads for _, _, heads in stages)
        # a head without a stage reads row 0, zero
        bags = (np.empty if every else np.zeros)((codebooks.heads, used, len(stages)), np.int64)
        for stage, (size, column, heads) in enumerate(stages):
            if len(heads) == codebooks.heads:  # in place: no temporary (this is most of a stored-window restore)
                np.add(
                    rows[size][:, column : column + len(heads)].T, offsets[layer, :, stage, None], out=bags[:, :, stage]
                )
            else:
                bags[heads, :, stage] = (
                    rows[size][:, column : column + len(heads)].T + offsets[layer, heads, stage, None]
                )
        summed = torch.nn.functional.embedding_bag(torch.from_numpy(bags.reshape(-1, len(stages))), table, mode="sum")
        return summed.numpy().reshape(codebooks.heads, used, codebooks.dim)

    for layer in range(codebooks.layers):
        yield gather("k", layer), gather("v", layer)
