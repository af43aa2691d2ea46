"""Restore time and fidelity by mode, side by side on the embedded model: exact prefill from
the token tier against the cache built from tier K (the archive), at several positions.

    .venv/bin/python benchmarks/restore.py [--tokens 2048] [--preset k4v3] [--runs 3]

Codebooks are trained on one real text and the session restored is a different one.
Appends a table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kvdb  # noqa: E402
from kvdb import quant  # noqa: E402
from corpus import real_text  # noqa: E402
from kvdb import tokenizer as tok  # noqa: E402
from report import describe, publish  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="length of the restored session")
    parser.add_argument("--preset", default=quant.DEFAULT_PRESET, help="default: the archive's default")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, kvdb.open(Path(tmp) / "bench.duckdb") as db:
        lm = db.loaded_model
        ids = np.asarray(tok.encode(lm.tokenizer, real_text(60_000)), dtype=np.int64)
        calibration = tok.decode(lm.tokenizer, ids[: 4096])
        session = tok.decode(lm.tokenizer, ids[-args.tokens :])
        db.ingest(text=calibration, name="calibration")
        trained = db.train_codebooks(preset=args.preset, tokens=4096)
        db.ingest(text=session, name="session", keep="tokens,kv")
        n = db.session("session").n_tokens
        rows = []
        for at in sorted({min(n, a) for a in (256, 1024, n)}):
            timing = {}
            for mode in ("exact", "archive"):
                times = []
                for _ in range(args.runs):
                    torch.manual_seed(0)
                    start = time.perf_counter()
                    db.restore("session", at=at, mode=mode)
                    times.append(time.perf_counter() - start)
                timing[mode] = statistics.median(times)
            fid = db.fidelity("session", at=min(n, at + 32)) if at + 32 <= n else db.fidelity("session", at=at)
            rows.append((at, timing["exact"], timing["archive"], fid))
        st = db.stats()
    lines = [
        f"\n## Restore by mode ({time.strftime('%Y-%m-%d')})\n",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/restore.py', *sys.argv[1:]])}` — {describe(f'torch {torch.__version__}')}; "
        f"SmolLM2-135M-Instruct; {args.preset} codebooks trained on 4,096 tokens of one text ({trained['seconds']} s), "
        f"restoring a {n}-token session of another; median of {args.runs}. Archive restores recompute the 4 sink and 32 most "
        f"recent positions. Tier K stored: {st.bytes_per_token['kv']:.1f} B/token, {st.kv_ratio_vs_fp16:.1f}x vs fp16; "
        f"codebooks {st.codebook_bytes / 1e6:.1f} MB.\n",
        "| restored tokens | exact prefill s | archive s | speed-up | top-1 agreement | ppl ratio (32-token probe) |",
        "|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {at} | {e:.3f} | {a:.3f} | {e / a:.1f}x | {f['top1_agreement']:.3f} | {f['ppl_ratio']:.4f} |"
            for at, e, a, f in rows
        ],
    ]
    publish(lines)


if __name__ == "__main__":
    main()
