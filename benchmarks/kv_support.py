"""What the tier K benchmarks (kv.py, kv_presets.py) need beyond the
library: a restore from whole arrays, codebooks cut down to a shallower preset, the exact
stored bytes of a set of codes. The library restores from streams layer by layer and stores one
trained preset, so none of these has a caller in kvdb/; they live here so a scan of presets and
window policies needs one training run and no archive.
"""

from __future__ import annotations

import numpy as np

from kvdb.codecs import fractal
from kvdb.codecs import quant as Q
from kvdb.codecs.code_layout import code_streams
from kvdb.codecs.entropy_coded import PAYLOAD
from kvdb.codecs.presets import KINDS, allocation, depths
from kvdb.errors import InvalidArgument
from kvdb.model import capture as C


def restore_cache(
    model,
    ids,
    keys,
    values,
    pre_rope: bool = False,
    sinks: int = C.SINKS,
    recent: int = C.RECENT,
    window: str = "recompute",
    exact_sinks: tuple[np.ndarray, np.ndarray] | None = None,
):
    """``capture.restore_layers`` of arrays ``[layers, kv_heads, seq, head_dim]``, left as they
    were (each layer copied as it is restored), so one decode serves several window policies."""
    copies = ((np.array(k, np.float32), np.array(v, np.float32)) for k, v in zip(keys, values))
    return C.restore_layers(model, ids, copies, pre_rope, sinks, recent, window, exact_sinks)


def truncate(codebooks: Q.Codebooks, preset: str) -> Q.Codebooks:
    """The codebooks of a preset that takes a prefix of ``codebooks``' stages in every head: stages
    nest, so one deep training run stands for every shallower preset (no retraining)."""
    alloc = allocation(preset, codebooks.layers, codebooks.heads)
    want = depths(preset, codebooks.layers, codebooks.heads)
    books: dict[str, list[list[np.ndarray]]] = {}
    kept: dict[str, np.ndarray] = {}
    for kind in KINDS:
        have_depth = codebooks.depth(kind)
        if (want[kind] > have_depth).any():
            layer, head = np.argwhere(want[kind] > have_depth)[0]
            raise InvalidArgument(
                f"preset {preset!r} needs {want[kind][layer, head]} {kind} stages "
                f"in layer {layer} head {head}; trained: {have_depth[layer, head]}"
            )
        books[kind] = []
        for layer, sizes in enumerate(alloc[kind]):
            have = codebooks.stages(kind)[layer]
            if tuple(have[: len(sizes)]) != tuple(sizes):
                raise InvalidArgument(
                    f"preset {preset!r} needs {kind} stages {sizes} in layer {layer}; trained: {have}"
                )
            stages = codebooks.books[kind][layer][: len(sizes)]
            short = want[kind][layer] < have_depth[layer].clip(max=len(sizes))
            if short.any():  # keep the invariant: a head's centroids past its depth are zero
                stages = [
                    np.where((want[kind][layer] > stage)[:, None, None], book, 0).astype(np.float32)
                    for stage, book in enumerate(stages)
                ]
            books[kind].append(stages)
        if not Q._uniform(want[kind], alloc[kind]):
            kept[kind] = want[kind]
    return Q.Codebooks(
        codebooks.layers,
        codebooks.heads,
        codebooks.dim,
        codebooks.pre_rope,
        books,
        preset,
        dict(codebooks.meta),
        dict(codebooks.weights),
        kept,
    )


def stored_code_bytes(
    codebooks: Q.Codebooks,
    codes: tuple[np.ndarray, np.ndarray],
    start: int = 0,
    block_size: int = fractal.DEFAULT_BLOCK,
) -> int:
    """Exact bytes of the code streams as the archive stores them (the fractal codec's block headers
    and CRCs included; an entropy-coded payload as it is): a preset's cost without writing an archive."""
    total = 0
    for size, symbols in code_streams(codebooks, codes, start).items():
        if size == PAYLOAD:  # an entropy-coded payload is stored as it is
            total += len(symbols)
        elif len(symbols):
            total += len(b"".join(fractal.encode_blocks(symbols, size, block_size)))
    return total
