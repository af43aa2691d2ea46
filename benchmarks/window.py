"""Where an archive restore without a forward pass loses quality: the recent window, or the rest?

    .venv/bin/python benchmarks/window.py [--deep k8v7] [--body k4v3] [--contexts 4] [--no-results]

Codebooks of ``--deep`` stages are trained once on the first 4,096 tokens of ``corpus.real_text``
(sinks left out, as the archive trains them); ``--body`` is a prefix of their stages (stages
nest), what the archive stores for every position. On held-out contexts of 1,024 tokens (the
offsets of benchmarks/kv.py), each followed by 128 teacher-forced tokens, it compares:

- the recomputed window (the default: sinks and the 32 most recent positions by a forward pass);
- the stored window (no forward pass: exact sinks, every other position at the body's stages);
- the same with the last 32 or 64 positions at the deep stages;
- the same with every position at the deep stages.

Pooled perplexity ratio against the exact cache, and top-1 agreement. Writes its table to
benchmarks/RESULTS.md, in place of the last run's.
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

from kvdb.codecs import presets as P
from kvdb.codecs import quant as Q
from kvdb.model import capture as C
from kvdb.model import loading as M
from kvdb.model import tokenizer as tok

CONTEXT, PROBE = 1024, 128
OFFSETS = [47436, 70865, 94294, 117723]  # benchmarks/kv.py's held-out contexts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deep", default="k8v7")
    parser.add_argument("--body", default=P.DEFAULT_PRESET)
    parser.add_argument("--contexts", type=int, default=len(OFFSETS))
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    loaded = M.load(None)
    model = loaded.model
    ids = np.asarray(tok.encode(loaded.tokenizer, real_text(600_000)), dtype=np.int64)
    k, v = C.capture(model, ids[:4096], pre_rope=True)
    began = time.perf_counter()
    books = Q.train({"k": k[:, :, C.SINKS :], "v": v[:, :, C.SINKS :]}, args.deep, pre_rope=True, niter=12)
    train_s = time.perf_counter() - began
    body = KS.truncate(books, args.body)
    stages = (body.max_stages("k"), body.max_stages("v"))
    scored: dict[str, list[tuple[float, int, float]]] = {}
    for start in OFFSETS[: args.contexts]:
        context, probe = ids[start : start + CONTEXT], ids[start + CONTEXT : start + CONTEXT + PROBE + 1]
        keys, values = C.capture(model, context, pre_rope=True)
        logp_exact, top_exact = C.teacher_forced(model, M.prefill(model, context), probe)
        codes = Q.encode(books, keys, values)
        body_k, body_v = Q.decode(books, (codes[0][:, :, : stages[0]], codes[1][:, :, : stages[1]]))
        deep_k, deep_v = Q.decode(books, codes)
        sinks = C.cache_arrays(M.prefill(model, context[: C.SINKS]))

        def score(name: str, cache, probe=probe, logp_exact=logp_exact, top_exact=top_exact) -> None:
            logp, top = C.teacher_forced(model, cache, probe)
            scored.setdefault(name, []).append((float(logp_exact.sum() - logp.sum()), len(logp), float((top == top_exact).mean())))

        score("recomputed window (sinks and recent 32 by a forward pass)", KS.restore_cache(model, context, body_k.copy(), body_v.copy(), pre_rope=True))
        score(f"stored window: exact sinks, every other position {args.body}", KS.restore_cache(model, context, body_k.copy(), body_v.copy(), pre_rope=True, window="stored", exact_sinks=sinks))
        for recent in (32, 64):
            k_mixed, v_mixed = body_k.copy(), body_v.copy()
            k_mixed[:, :, -recent:], v_mixed[:, :, -recent:] = deep_k[:, :, -recent:], deep_v[:, :, -recent:]
            score(f"stored window, the last {recent} at {args.deep}", KS.restore_cache(model, context, k_mixed, v_mixed, pre_rope=True, window="stored", exact_sinks=sinks))
        score(f"stored window, every position at {args.deep}", KS.restore_cache(model, context, deep_k.copy(), deep_v.copy(), pre_rope=True, window="stored", exact_sinks=sinks))
        print(start, {name: round(float(np.exp(r[-1][0] / r[-1][1])), 4) for name, r in scored.items()}, file=sys.stderr, flush=True)
    lines = [
        "\n## Where a restore without a forward pass loses quality (`benchmarks/window.py`)\n",
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. `{' '.join(['.venv/bin/python', 'benchmarks/window.py', *sys.argv[1:]])}` — {describe()}; SmolLM2-135M-Instruct; {args.deep} codebooks "
        f"trained on 4,096 tokens ({train_s:.0f} s), {args.body} their first stages; {args.contexts} held-out contexts of {CONTEXT} tokens "
        f"(offsets {OFFSETS[: args.contexts]}), each followed by {PROBE} teacher-forced tokens; ppl ratio pooled over them, top-1 their mean.\n",
        "| restore | ppl ratio | per-context | top-1 agreement |",
        "|---|---:|---|---:|",
        *[
            f"| {name} | {np.exp(sum(d for d, _, _ in r) / sum(n for _, n, _ in r)):.4f} | "
            f"{', '.join(f'{np.exp(d / n):.3f}' for d, n, _ in r)} | {np.mean([t for _, _, t in r]):.3f} |"
            for name, r in scored.items()
        ],
    ]
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
