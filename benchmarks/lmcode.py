"""Tier L benchmark: tokens coded against the model's own distribution, against the model's
cross-entropy and the usual text compressors; and the determinism study behind its design.

    .venv/bin/python benchmarks/lmcode.py [--quick]

Three samples of real text (licence/README prose found on this machine, Python standard-library
source, and the example chat transcripts rendered with the model's chat template), each cut to a
token budget. For each: bits/token of the coded payload against the model's cross-entropy on the
same tokens (from one batched chunked forward pass), bytes against gzip -9, xz -9e and zstd -19 on
the same text, encode and decode throughput. Determinism: the logits the encoder computes one
token at a time are compared with the batched pass's, raw and after quantisation; and the
one-token step is rerun with 2 intra-op threads to compare with the 1 thread coding pins.

Writes its section of benchmarks/RESULTS.md, in place of the last run's (``--quick`` only prints).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import lzma
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from corpus import real_text  # noqa: E402
from report import describe, publish  # noqa: E402

from kvdb.model import (  # noqa: E402
    chat,
    integer_kernel,
    lmcode,
)
from kvdb.model import loading as lm_ops  # noqa: E402
from kvdb.model import tokenizer as tok  # noqa: E402

CODE_FILES = ("json/decoder.py", "textwrap.py", "heapq.py", "bisect.py")
CHUNK = 512


# -- samples --------------------------------------------------------------------------------


def code_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((stdlib / name).read_text(encoding="utf-8") for name in CODE_FILES)


def chat_text(tokenizer) -> str:
    folder = ROOT / "examples" / "transcripts"
    conversations = [[json.loads(line) for line in (folder / "chat.jsonl").read_text().splitlines() if line.strip()]]
    for line in (folder / "sessions.jsonl").read_text().splitlines():
        if line.strip():
            conversations.append(json.loads(line)["messages"])
    return "".join(chat.render(tokenizer, messages) for messages in conversations)


def samples(tokenizer, budgets: dict[str, int]) -> dict[str, np.ndarray]:
    texts = {"prose": real_text(budgets["prose"] * 8), "code": code_text(), "chat": chat_text(tokenizer)}
    return {name: np.asarray(tok.encode(tokenizer, texts[name]), dtype=np.int64)[: budgets[name]] for name in texts}


# -- measurements ---------------------------------------------------------------------------


@torch.no_grad()
def batched_logits(model, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """Next-token logits of every position by chunked forward passes (ingest's computation), and tok/s."""
    out = np.empty((ids.size, lmcode.vocab_size(model)), dtype=np.float32)
    cache = lm_ops.new_cache(model)
    began = time.perf_counter()
    for start in range(0, ids.size, CHUNK):
        chunk = torch.as_tensor(ids[start : start + CHUNK])[None]
        out[start : start + chunk.shape[1]] = model(chunk, cache=cache, use_cache=True).logits[0].float().numpy()
    return out, ids.size / (time.perf_counter() - began)


def cross_entropy_bits(logits: np.ndarray, ids: np.ndarray) -> float:
    """Total -log2 p(ids) under float64 softmax of the logits; the first token costs log2(vocab)."""
    total = math.log2(logits.shape[1])
    for start in range(0, ids.size - 1, 256):
        rows = logits[start : min(start + 256, ids.size - 1)].astype(np.float64)
        top = rows.max(1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(rows - top).sum(1))
        total += float(
            (lse - rows[np.arange(rows.shape[0]), ids[start + 1 : start + 1 + rows.shape[0]]]).sum()
        ) / math.log(2)
    return total


class Recorder:
    """Wraps lmcode._step to keep every row of logits and the time of every step."""

    def __init__(self, keep_rows: bool = True):
        self.rows, self.seconds, self.inner, self.keep_rows = [], [], lmcode._step, keep_rows

    def __call__(self, model, cache, token):
        began = time.perf_counter()
        row = self.inner(model, cache, token)
        self.seconds.append(time.perf_counter() - began)
        if self.keep_rows:
            self.rows.append(row)
        return row

    def __enter__(self):
        lmcode._step = self
        return self

    def __exit__(self, *exc):
        lmcode._step = self.inner


def compressors(data: bytes) -> dict[str, int]:
    return {
        "gzip -9": len(gzip.compress(data, 9)),
        "xz -9e": len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)),
        "zstd -19": len(zstandard.ZstdCompressor(level=19).compress(data)),
    }


def run_sample(lm, name: str, ids: np.ndarray) -> dict:
    model = lm.model
    text = tok.decode(lm.tokenizer, ids)
    batched, batched_tps = batched_logits(model, ids)
    xent = cross_entropy_bits(batched, ids)

    with Recorder() as enc_steps:
        began = time.perf_counter()
        payload = lmcode.encode(model, ids, version=1)
        encode_s = time.perf_counter() - began
    with Recorder(keep_rows=False) as dec_steps:
        began = time.perf_counter()
        out, ctx = lmcode.decode(model, payload)
        decode_s = time.perf_counter() - began
    assert np.array_equal(out, ids) and ctx.length == ids.size

    stepwise = np.stack(enc_steps.rows)[: ids.size - 1]  # rows 0..n-2: logits after token i, as batched[i]
    quantised = math.log2(batched.shape[1]) + sum(
        lmcode.PRECISION - math.log2(lmcode.frequencies(stepwise[i])[ids[i + 1]]) for i in range(ids.size - 1)
    )
    same_bits = same_cdf = 0
    for i in range(ids.size - 1):
        same_bits += np.array_equal(stepwise[i].view(np.uint32), batched[i].view(np.uint32))
        same_cdf += np.array_equal(lmcode.frequencies(stepwise[i]), lmcode.frequencies(batched[i]))
    diff = np.abs(stepwise - batched[: ids.size - 1])
    began = time.perf_counter()
    portable = lmcode.encode(model, ids, version=3)  # batched chunks of the integer forward pass
    encode_v3_s = time.perf_counter() - began
    began = time.perf_counter()
    out, _ = lmcode.decode(model, portable)  # one integer step per token
    decode_v3_s = time.perf_counter() - began
    assert np.array_equal(out, ids)
    return {
        "v3_payload": len(portable),
        "v3_body": len(portable) - lmcode.read_header(portable).size,
        "v3_encode_tps": ids.size / encode_v3_s,
        "v3_decode_tps": ids.size / decode_v3_s,
        "name": name,
        "tokens": ids.size,
        "text_bytes": len(text.encode()),
        "baselines": compressors(text.encode()),
        "payload": len(payload),
        "body": len(payload) - lmcode.read_header(payload).size,
        "xent_bits": xent,
        "quantised_bits": quantised,
        "encode_tps": ids.size / encode_s,
        "decode_tps": ids.size / decode_s,
        "step_ms": 1e3 * float(np.median(enc_steps.seconds + dec_steps.seconds)),
        "batched_tps": batched_tps,
        "rows": ids.size - 1,
        "same_bits": int(same_bits),
        "same_cdf": int(same_cdf),
        "max_diff": float(diff.max()),
        "median_row_max_diff": float(np.median(diff.max(1))),
    }


def thread_check(model, ids: np.ndarray) -> str:
    """The one-token step with 1 and with 2 intra-op threads: are the logits bit-identical?"""
    rows = {}
    for threads in (1, 2):
        cache, got = lm_ops.new_cache(model), []
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                for token in ids.tolist():
                    got.append(lmcode._step(model, cache, token))
        finally:
            torch.set_num_threads(previous)
        rows[threads] = np.stack(got)
    same = sum(np.array_equal(a, b) for a, b in zip(rows[1], rows[2]))
    same_cdf = sum(np.array_equal(lmcode.frequencies(a), lmcode.frequencies(b)) for a, b in zip(rows[1], rows[2]))
    return (
        f"one-token step, 1 vs 2 intra-op threads, {ids.size} prose tokens: {same} rows of logits bit-identical, "
        f"{same_cdf} quantised CDFs identical, max |diff| {np.abs(rows[1] - rows[2]).max():.2e}"
    )


# -- report ---------------------------------------------------------------------------------


def table(results: list[dict]) -> list[str]:
    lines = [
        "| sample | tokens | text B | gzip -9 B | xz -9e B | zstd -19 B | tier L v1 B (body) | xz / L | "
        "cross-entropy bits/tok | quantised ideal bits/tok | L body bits/tok | L payload bits/tok | L body / CE | "
        "encode tok/s | decode tok/s | median step ms | batched fwd tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total = {
        "name": "**all**",
        "text_bytes": 0,
        "tokens": 0,
        "payload": 0,
        "body": 0,
        "xent_bits": 0.0,
        "quantised_bits": 0.0,
        "baselines": {},
        "v3_payload": 0,
        "v3_body": 0,
    }
    for r in results:
        for key in ("text_bytes", "tokens", "payload", "body", "xent_bits", "quantised_bits", "v3_payload", "v3_body"):
            total[key] += r[key]
        for key, value in r["baselines"].items():
            total["baselines"][key] = total["baselines"].get(key, 0) + value
    for r in [*results, total]:
        n, b = r["tokens"], r["baselines"]
        timing = (
            f"{r['encode_tps']:.1f} | {r['decode_tps']:.1f} | {r['step_ms']:.1f} | {r['batched_tps']:.0f}"
            if "encode_tps" in r
            else "| | |"
        )
        lines.append(
            f"| {r['name']} | {n:,} | {r['text_bytes']:,} | {b['gzip -9']:,} | {b['xz -9e']:,} | {b['zstd -19']:,} | "
            f"{r['payload']:,} ({r['body']:,}) | {b['xz -9e'] / r['payload']:.2f} | {r['xent_bits'] / n:.3f} | "
            f"{r['quantised_bits'] / n:.3f} | {8 * r['body'] / n:.3f} | {8 * r['payload'] / n:.3f} | "
            f"{8 * r['body'] / r['xent_bits']:.4f} | {timing} |"
        )
    return lines


def v3_table(results: list[dict]) -> list[str]:
    """Payload version 3 (kvdb.model.integer_lm, by its compiled kernel) beside version 1, on the same tokens."""
    lines = [
        "| sample | tokens | xz -9e B | v1 B (body) | v3 B (body) | xz / v3 | v1 body / CE | v3 body / CE | v3 payload "
        "/ CE | v1 encode tok/s | v3 encode tok/s | v1 decode tok/s | v3 decode tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total = {
        key: sum(r[key] for r in results) for key in ("tokens", "payload", "body", "v3_payload", "v3_body", "xent_bits")
    }
    total["xz"] = sum(r["baselines"]["xz -9e"] for r in results)
    for r in [*results, {"name": "**all**", **total}]:
        xz = r.get("xz", r.get("baselines", {}).get("xz -9e"))
        timing = (
            f"{r['encode_tps']:.1f} | {r['v3_encode_tps']:.1f} | {r['decode_tps']:.1f} | {r['v3_decode_tps']:.1f}"
            if "encode_tps" in r
            else "| | |"
        )
        lines.append(
            f"| {r['name']} | {r['tokens']:,} | {xz:,} | {r['payload']:,} ({r['body']:,}) | {r['v3_payload']:,} "
            f"({r['v3_body']:,}) | {xz / r['v3_payload']:.2f} | {8 * r['body'] / r['xent_bits']:.4f} | "
            f"{8 * r['v3_body'] / r['xent_bits']:.4f} | {8 * r['v3_payload'] / r['xent_bits']:.4f} | {timing} |"
        )
    return lines


def determinism_table(results: list[dict]) -> list[str]:
    lines = [
        "| sample | positions | logits bit-identical | quantised "
        "CDF identical | max abs diff | median per-row max abs diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['rows']:,} | {r['same_bits']:,} | {r['same_cdf']:,} "
            f"({100 * r['same_cdf'] / r['rows']:.1f}%) | {r['max_diff']:.2e} | {r['median_row_max_diff']:.2e} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small samples; print only")
    args = parser.parse_args()
    budgets = {"prose": 160, "code": 120, "chat": 120} if args.quick else {"prose": 800, "code": 500, "chat": 500}
    started, where = datetime.datetime.now(datetime.UTC), describe(f"torch {torch.__version__}")
    lm = lm_ops.load()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))  # batched passes as ingest runs them
    began = time.perf_counter()
    lmcode._integer(lm.model, 3)  # version 3's weights, quantized once a process: not in the encode timings
    integer_build_s = time.perf_counter() - began
    results = []
    for name, ids in samples(lm.tokenizer, budgets).items():
        results.append(run_sample(lm, name, ids))
        print(table(results)[-2], flush=True)
    prose = samples(lm.tokenizer, {"prose": 60 if args.quick else 200, "code": 1, "chat": 1})["prose"]
    threads = thread_check(lm.model, prose)
    lines = [
        f"Run at {started:%Y-%m-%d %H:%M} UTC.  ",
        f"Command: `python benchmarks/lmcode.py{' --quick' if args.quick else ''}`  ",
        f"Machine: {where}; load average at end {os.getloadavg()[0]:.1f}  ",
        "Samples: prose = licence/README text of installed packages (`benchmarks/corpus.py`); code = Python stdlib "
        f"{', '.join(CODE_FILES)}; chat = `examples/transcripts` chat.jsonl + sessions.jsonl rendered with the chat "
        "template; each cut to its token budget. Baselines compress the UTF-8 text of exactly those tokens. Tier L "
        "bytes count the whole payload (its 20-24-byte header included; body = range-coder words only). Cross-entropy: "
        "float64 softmax of one batched chunked forward pass (first token: log2 vocab). Quantised ideal: -log2 of the "
        "integer frequencies the coder uses. Timings (version 1): one encode and one decode per sample (the model runs "
        "one token per step, 1 intra-op thread); median step = median time of one model step over encode and decode; "
        "batched fwd = chunked forward of 512 tokens, 2 threads.",
        "",
        *table(results),
        "",
        "Payload version 3 (the default where the model has kvdb.model.integer_lm's forward pass: portable) beside "
        "version 1, on the same tokens. v3 runs the pass's compiled kernel (kvdb/model/integer_kernel.c, "
        f"{integer_kernel.ISA} dot products): it encodes with batched chunks of 256 tokens on 2 threads and decodes "
        "one integer step per token; CE is the float model's cross-entropy as above; the payload column counts v3's "
        "header. Quantizing the model's weights for it took "
        f"{integer_build_s:.1f} s, once a process, before the timings.",
        "",
        *v3_table(results),
        "",
        "Determinism (version 1): next-token logits of the one-token step (encoder and decoder) against the batched "
        "chunked pass, raw float32 and after quantisation to integer CDFs:",
        "",
        *determinism_table(results),
        "",
        threads + ".",
        "",
    ]
    publish(f"Tier L: tokens coded against the model, {lm.identity.name}", lines, append=not args.quick)


if __name__ == "__main__":
    main()
