"""Which layers a verbatim copy depends on: the one-layer scan behind kv.py's COPY_LAYERS.

    .venv/bin/python benchmarks/copy_scan.py [--context 1024] [--no-results]

Takes two held-out contexts of ``corpus.real_text`` past its first 30,000 tokens (kv.py
calibrates on the first 8,192): the first whose next 129 tokens occur verbatim inside it (a
continuation the model can copy: licence files repeat), and the first whose next 64 tokens do
not. For each, with the shipped codebooks (k4v3, what ``--keep kv`` uses), it quantizes the
keys of one layer only, or the values of one layer only, every other layer and position exact,
restores the cache with the window recomputed (as the archive does), and reports the
perplexity ratio of the 128 teacher-forced tokens against the exact cache; and the whole cache
quantized. Writes its table to benchmarks/RESULTS.md, in place of the last run's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import kv_support as KS
from corpus import real_text
from report import describe, publish

from kvdb.codecs import quant as Q
from kvdb.model import capture as C
from kvdb.model import loading as M
from kvdb.model import tokenizer as tok
from kvdb.services import shipped_codebooks as SH

PROBE = 128
FIRST = 30_000


def occurs_in(needle: np.ndarray, haystack: np.ndarray) -> bool:
    """Whether ``needle`` is a contiguous run of ``haystack`` (token ids)."""
    hay, pin = haystack.astype("<i4").tobytes(), needle.astype("<i4").tobytes()
    at = hay.find(pin)
    while at != -1 and at % 4:
        at = hay.find(pin, at + 1)
    return at != -1


def pick(ids: np.ndarray, n: int, copying: bool) -> int:
    """The first context start (on a 256-token grid) whose continuation is, or is not, a copy."""
    for start in range(FIRST, len(ids) - n - PROBE - 1, 256):
        context, after = ids[start : start + n], ids[start + n : start + n + PROBE + 1]
        if occurs_in(after if copying else after[:64], context) == copying:
            return start
    raise SystemExit(f"no context of {n} tokens whose continuation {'is' if copying else 'is not'} a copy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    began = time.perf_counter()
    loaded = M.load(None)
    model, n = loaded.model, args.context
    layers = model.config.num_hidden_layers
    ids = np.asarray(tok.encode(loaded.tokenizer, real_text(600_000)), dtype=np.int64)
    books = SH.build(loaded)[1]
    columns = {}
    for label, copying in (("copy", True), ("no copy", False)):
        start = pick(ids, n, copying)
        context, probe = ids[start : start + n], ids[start + n : start + n + PROBE + 1]
        keys, values = C.capture(model, context, pre_rope=True)
        logp_exact, _ = C.teacher_forced(model, M.prefill(model, context), probe)
        key_q, value_q = Q.decode(books, Q.encode(books, keys, values))

        def ratio(k: np.ndarray, v: np.ndarray, context=context, probe=probe, logp_exact=logp_exact) -> float:
            logp, _ = C.teacher_forced(model, KS.restore_cache(model, context, k, v, pre_rope=True), probe)
            return float(np.exp(logp_exact.mean() - logp.mean()))

        scan = {"all": ratio(key_q.copy(), value_q.copy())}
        for layer in range(layers):
            for kind in ("k", "v"):
                k, v = keys.copy(), values.copy()
                (k if kind == "k" else v)[layer] = (key_q if kind == "k" else value_q)[layer]
                scan[(layer, kind)] = ratio(k, v)
        columns[f"{label} (offset {start})"] = scan
        print(f"{label} context at {start} scanned ({time.perf_counter() - began:.0f} s)", flush=True)
    names = list(columns)
    lines = [
        "\n## Which layers a verbatim copy depends on (`benchmarks/copy_scan.py`)\n",
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. `.venv/bin/python benchmarks/copy_scan.py{' --context ' + str(n) if n != 1024 else ''}` — {describe()}; "
        f"SmolLM2-135M-Instruct; shipped k4v3 codebooks; contexts of {n} tokens from `corpus.real_text` past token {FIRST:,}: "
        f"the first whose next {PROBE + 1} tokens occur verbatim inside it (\"copy\") and the first whose next 64 do not "
        f"(\"no copy\"). Each cell: the perplexity ratio of the {PROBE} teacher-forced tokens when only that layer's keys (K) "
        f"or values (V) are quantized, everything else exact, window recomputed. Total {time.perf_counter() - began:.0f} s.\n",
        "| quantized | " + " | ".join(f"{c}: K | {c}: V" for c in names) + " |",
        "|---|" + "---:|---:|" * len(names),
        "| every layer, K and V | " + " | ".join(f"{columns[c]['all']:.3f} | —" for c in names) + " |",
    ]
    for layer in range(layers):
        lines.append(f"| layer {layer} | " + " | ".join(f"{columns[c][(layer, 'k')]:.3f} | {columns[c][(layer, 'v')]:.3f}" for c in names) + " |")
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
