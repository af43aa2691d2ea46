"""Restore time and fidelity by mode, side by side on the embedded model: the exact prefill from
the token tier against the cache built from tier K (the archive) with each window policy, at
1,024, 4,096 and 8,000 tokens, beside the memory-bandwidth floor of writing that cache.

    .venv/bin/python benchmarks/restore.py [--tokens 1024,4096,8000] [--preset P] [--runs 3]

Codebooks are trained on one real text and the sessions restored are others (one session per
length, each restored whole). The archive's "stored" window runs no forward pass (the sinks come
from this machine's cache of them, filled by one restore before timing); "recompute" runs one
over the sinks and the 32 most recent positions. The floor is the fp32 cache's bytes over the
rate this machine copies a tensor of that size (read + write). Appends a table to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import describe, median_seconds, publish

import kvdb
from kvdb.model import tokenizer as tok

PROBE = 32  # teacher-forced tokens after the restored prefix


def copy_floor(nbytes: int, runs: int = 5) -> float:
    """Seconds to copy ``nbytes`` once (read and write), best of ``runs``: what building a cache
    of that size cannot beat."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,8000", help="session lengths restored")
    parser.add_argument(
        "--preset",
        default=None,
        help="a name (faithful, balanced, compact) or a spec; default: balanced (presets.DEFAULT_NAME)",
    )
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb") as db:
        lm = db.loaded_model
        config = lm.model.config
        ids = np.asarray(tok.encode(lm.tokenizer, real_text(200_000 + 6 * sum(lengths))), dtype=np.int64)
        db.ingest(text=tok.decode(lm.tokenizer, ids[:4096]), name="calibration")
        trained = db.train_codebooks(preset=args.preset, tokens=4096)
        rows, at = [], len(ids)
        for n in lengths:  # each session a different stretch of the text, from its end back
            db.ingest(text=tok.decode(lm.tokenizer, ids[at - n - PROBE : at]), name=f"s{n}", keep="tokens,kv")
            at -= n + PROBE + 1000
        for n in lengths:
            session = db.session(f"s{n}")
            cut = session.n_tokens - PROBE
            # this machine's sink cache, filled once
            db.restore(session.session_id, at=cut, mode="archive", window="stored")
            timing = {
                "exact": median_seconds(partial(db.restore, session.session_id, at=cut, mode="exact"), args.runs),
                "stored": median_seconds(
                    partial(db.restore, session.session_id, at=cut, mode="archive", window="stored"), args.runs
                ),
                "recompute": median_seconds(
                    partial(db.restore, session.session_id, at=cut, mode="archive", window="recompute"), args.runs
                ),
            }
            fidelity = {w: db.fidelity(session.session_id, probe=PROBE, window=w) for w in ("stored", "recompute")}
            cache_bytes = (
                2
                * config.num_hidden_layers
                * config.num_key_value_heads
                * (config.hidden_size // config.num_attention_heads)
                * cut
                * 4
            )
            rows.append((cut, timing, fidelity, cache_bytes, copy_floor(cache_bytes)))
            print(rows[-1], file=sys.stderr, flush=True)
        st = db.stats()
    lines = [
        f"`{' '.join(['.venv/bin/python', 'benchmarks/restore.py', *sys.argv[1:]])}` ({time.strftime('%Y-%m-%d')}) — "
        f"{describe(f'torch {torch.__version__}')}; SmolLM2-135M-Instruct; {trained['preset']} codebooks trained on "
        f"4,096 tokens of one text ({trained['seconds']} s); each session another stretch of text, restored at its "
        f"length less a {PROBE}-token probe; median of {args.runs}. Archive, stored window: no forward pass (4 exact "
        "sinks from this machine's sink cache, the rest from tier K). Archive, recomputed window: sinks and the 32 "
        "most recent positions recomputed in one forward pass. Floor: the fp32 cache's bytes copied once at this "
        f"machine's best copy rate. Fidelity: top-1 agreement and perplexity ratio of the {PROBE} teacher-forced "
        f"tokens after the restored prefix, against the exact cache. Tier K stored: {st.bytes_per_token['kv']:.1f} "
        f"B/token, {st.kv_ratio_vs_fp16:.1f}x vs fp16; codebooks {st.codebook_bytes / 1e6:.1f} MB.\n",
        "| restored tokens | fp32 cache MB | floor s | exact prefill s | archive, stored window s | speed-up | "
        "archive, recomputed window s | speed-up | stored: top-1 / ppl ratio | recomputed: top-1 / ppl ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {cut} | {nbytes / 1e6:.0f} | {floor:.3f} | {t['exact']:.3f} | {t['stored']:.3f} | "
            f"{t['exact'] / t['stored']:.1f}x | {t['recompute']:.3f} | {t['exact'] / t['recompute']:.1f}x | "
            f"{f['stored'].top1_agreement:.3f} / {f['stored'].ppl_ratio:.4f} | "
            f"{f['recompute'].top1_agreement:.3f} / {f['recompute'].ppl_ratio:.4f} |"
            for cut, t, f, nbytes, floor in rows
        ],
    ]
    publish(f"Restore by mode and window: {trained['preset']}", lines)


if __name__ == "__main__":
    main()
