"""Multi-turn conversations replayed through the official `openai` client: time to first token
(TTFT) and total time per turn, side by side in one run, for

    (a) kvdb serve;
    (b) kvdb serve, killed with SIGKILL and started again between turns;
    (c) the same model served with no reuse: every turn prefilled from scratch, as a stock
        server does after a restart (a minimal transformers server defined here);
    (d) the same GGUF behind llama-cpp-python's OpenAI server, warm and restarted between turns
        (when ``--llama-python`` names a Python with ``llama_cpp.server`` installed).

    .venv/bin/python benchmarks/serve.py [--conversations 6] [--turns 8] [--document-words 1800]
        [--words 60] [--max-tokens 16] [--llama-python /path/to/python] [--baseline SRC] [--no-results]

``--baseline SRC`` runs (a) once more from another checkout of kvdb (its source tree, with its
kernel built), side by side in the same run: a before/after of a change. The ``archive`` mode
measures what each exchange costs after its reply, per server: the seconds until the archive
holds it (the journal emptied), and the time to first token of a follow-up sent 1.5 s after a
long first exchange, while that exchange is being archived.

Each conversation opens with a document of ``--document-words`` words of real text (licences and
docs on this machine) to summarise, then asks about ``--words`` more words in each later turn:
the shape of a chat over a long context, past 3,000 tokens by its 8th turn, where a server that
reuses caches computes only each turn's new words. Replies are greedy
(temperature 0). TTFT is measured from the request to the first streamed content; cached
tokens come from ``usage.prompt_tokens_details.cached_tokens``. A last run replays the
conversations with 4 concurrent clients against (a) and counts failed requests. Appends a
section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from corpus import real_text
from report import describe, publish

ROOT = Path(__file__).resolve().parents[1]
KVDB = Path(sys.executable).with_name("kvdb")
SYSTEM = "You are a concise, friendly assistant. Answer in plain language and show code only when it helps."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port, started and killed on demand."""

    def __init__(self, argv: list[str], env: dict | None = None, health: str = "/health"):
        self.argv, self.env, self.health = argv, env, health
        self.port = free_port()
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 300) -> float:
        """Seconds until the server answers its health route."""
        began = time.perf_counter()
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        self.log = tempfile.TemporaryFile()  # a pipe nobody reads would fill up and stop the server
        self.process = subprocess.Popen(argv, env=self.env, stdout=self.log, stderr=self.log, start_new_session=True)
        while time.perf_counter() - began < timeout:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{argv[0]} exited: {self.log.read().decode(errors='replace')[-2000:]}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.health}", timeout=1)
                return time.perf_counter() - began
            time.sleep(0.2)
        raise RuntimeError(f"{argv[0]} did not answer within {timeout} s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def conversations(n: int, turns: int, document_words: int, words: int) -> list[list[str]]:
    """``n`` conversations of ``turns`` user messages: a document, then follow-ups, every one a
    distinct slice of real text."""
    per_conversation = document_words + (turns - 1) * words
    text = real_text(n * per_conversation * 16).split()
    assert len(text) >= n * per_conversation, "not enough text on this machine"
    out = []
    for c in range(n):
        at = c * per_conversation
        users = [f"Summarise this document in one sentence:\n\n{' '.join(text[at : at + document_words])}"]
        for t in range(1, turns):
            begin = at + document_words + (t - 1) * words
            users.append(f"And what does this passage add?\n\n{' '.join(text[begin : begin + words])}")
        out.append(users)
    return out


def turn(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: TTFT, total seconds, reply, prompt and cached tokens."""
    began = time.perf_counter()
    first, reply, usage = None, [], None
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            reply.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft": (first or end) - began,
        "total": end - began,
        "reply": "".join(reply),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
    }


def replay(server: Server, dialogues: list[list[str]], max_tokens: int, restart: bool) -> list[list[dict]]:
    """Every conversation turn by turn; with ``restart``, a SIGKILL and a fresh start before each turn after
    the first."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    out = []
    for users in dialogues:
        messages, rows = [{"role": "system", "content": SYSTEM}], []
        for index, user in enumerate(users):
            ready = None
            if restart and index:
                server.kill()
                ready = server.start()
            messages.append({"role": "user", "content": user})
            row = dict(turn(client, messages, max_tokens), ready=ready)
            messages.append({"role": "assistant", "content": row["reply"]})
            rows.append(row)
        out.append(rows)
    return out


def shim(source: str, folder: str) -> str:
    """A folder that maps the names a baseline from before one package tree installed its front
    ends under (``kvdb_cli``, ``kvdb_server``, ``kvdb_mcp``, ``kvdb_migrations``) to its folders,
    so that it runs its own CLI and server (a later baseline holds them in its ``kvdb/``)."""
    path = Path(folder) / "baseline-shim"
    path.mkdir(exist_ok=True)
    for name, where in (
        ("kvdb_cli", "cli"),
        ("kvdb_server", "server"),
        ("kvdb_mcp", "mcpserver"),
        ("kvdb_migrations", "migrations"),
    ):
        if (Path(source) / where).is_dir() and not (path / name).exists():
            (path / name).symlink_to(Path(source).resolve() / where)
    return str(path)


def journal_entries(db: Path) -> int:
    return len(list(db.with_name(db.name + ".serve").glob("*.json")))


def archiving(server: Server, db: Path, dialogues: list[list[str]], max_tokens: int, pause: float = 1.5) -> dict:
    """Per conversation: the reply's total seconds and the seconds until the archive holds the
    exchange, turn by turn; then, on a new conversation of the same first turn, the TTFT of a
    follow-up sent ``pause`` seconds after the first reply (the archiving of which it meets)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    rows = []
    for users in dialogues:
        messages = [{"role": "system", "content": SYSTEM}]
        for user in users:
            messages.append({"role": "user", "content": user})
            row = turn(client, messages, max_tokens)
            began = time.perf_counter()
            while journal_entries(db) and time.perf_counter() - began < 600:
                time.sleep(0.02)
            rows.append(
                {"total": row["total"], "archive": time.perf_counter() - began, "prompt_tokens": row["prompt_tokens"]}
            )
            messages.append({"role": "assistant", "content": row["reply"]})
    follow = []
    for users in dialogues:
        # not archived before: a new conversation
        messages = [{"role": "system", "content": SYSTEM + " "}, {"role": "user", "content": users[0]}]
        first = turn(client, messages, max_tokens)
        time.sleep(pause)
        messages += [{"role": "assistant", "content": first["reply"]}, {"role": "user", "content": users[1]}]
        follow.append(turn(client, messages, max_tokens))
    return {
        "turns": rows,
        "follow_ttft": [f["ttft"] for f in follow],
        "follow_prompt": [f["prompt_tokens"] for f in follow],
    }


def concurrent_failures(
    server: Server, dialogues: list[list[str]], max_tokens: int, clients: int = 4
) -> tuple[int, int, list[str]]:
    """(failed, total, the kinds of failure) of requests with ``clients`` conversations replayed at once."""
    from openai import OpenAI

    counts = {"failed": 0, "total": 0}
    reasons: list[str] = []
    lock = threading.Lock()

    def one(users):
        client = OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "system", "content": SYSTEM}]
        for user in users:
            messages.append({"role": "user", "content": user})
            try:
                row = turn(client, messages, max_tokens)
                failed = 0
            except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its kind
                row, failed = {"reply": ""}, 1
                with lock:
                    reasons.append(f"{type(exc).__name__} {getattr(exc, 'status_code', '')}".strip())
            messages.append({"role": "assistant", "content": row["reply"]})
            with lock:
                counts["failed"] += failed
                counts["total"] += 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, dialogues[:clients]))
    return counts["failed"], counts["total"], sorted(set(reasons))


STOCK = '''
"""A stock server: the same model, every request prefilled from scratch (no cache reuse)."""
import json, sys, time, threading
import torch, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from transformers import TextIteratorStreamer
from kvdb.model import chat, loading as lm_ops
loaded = lm_ops.load(None)
app = FastAPI()
lock = threading.Lock()

@app.get("/health")
def health():
    return {"status": "ok"}

@app.post("/v1/chat/completions")
async def complete(request: Request):
    body = await request.json()
    text = chat.render(loaded.tokenizer, body["messages"], add_generation_prompt=True)
    ids = loaded.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
    def run():
        with lock, torch.no_grad():
            loaded.model.generate(ids, max_new_tokens=body.get("max_tokens", 16), do_sample=False, streamer=streamer)
    threading.Thread(target=run, daemon=True).start()
    def events():
        for piece in streamer:
            if piece:
                yield "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", \
"created": int(time.time()), "model": "stock",
                                             "choices": [{"index": 0, "delta": {"content": piece}, \
"finish_reason": None}]}) + "\\n\\n"
        usage = {"prompt_tokens": ids.shape[1], "completion_tokens": 0, "total_tokens": ids.shape[1], \
"prompt_tokens_details": {"cached_tokens": 0}}
        yield "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": int(time.time()), \
"model": "stock", "choices": [], "usage": usage}) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(events(), media_type="text/event-stream")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def summarise(runs: dict[str, list[list[dict]]], turns: int) -> list[str]:
    names = list(runs)
    header = (
        "| turn | prompt tokens | "
        + " | ".join(f"{n} TTFT s (cached)" for n in names)
        + " | "
        + " | ".join(f"{n} total s" for n in names)
        + " |"
    )
    lines = [header, "|" + "---:|" * (2 + 2 * len(names))]
    for t in range(turns):
        rows = {n: [conv[t] for conv in runs[n]] for n in names}
        prompt = statistics.mean(r["prompt_tokens"] or 0 for r in rows[names[0]])
        ttft = " | ".join(
            f"{statistics.median(r['ttft'] for r in rows[n]):.3f} "
            f"({statistics.mean((r['cached_tokens'] or 0) for r in rows[n]):.0f})"
            for n in names
        )
        total = " | ".join(f"{statistics.median(r['total'] for r in rows[n]):.3f}" for n in names)
        lines.append(f"| {t + 1} | {prompt:.0f} | {ttft} | {total} |")
    return lines


def archive_table(costs: dict[str, dict], turns: int) -> list[str]:
    """Per turn, each server's reply seconds and the seconds until its archive held the
    exchange (medians over the conversations); then the follow-up TTFTs."""
    names = list(costs)
    lines = [
        "Each exchange's cost after its reply (a fresh server each, "
        "turns sent one after another once the last is archived):",
        "",
        "| turn | prompt tokens | " + " | ".join(f"{n} reply s | {n} archived after s" for n in names) + " |",
        "|" + "---:|" * (2 + 2 * len(names)),
    ]
    for t in range(turns):
        rows = {n: costs[n]["turns"][t::turns] for n in names}
        prompt = statistics.mean(r["prompt_tokens"] or 0 for r in rows[names[0]])
        cells = " | ".join(
            f"{statistics.median(r['total'] for r in rows[n]):.3f} | "
            f"{statistics.median(r['archive'] for r in rows[n]):.3f}"
            for n in names
        )
        lines.append(f"| {t + 1} | {prompt:.0f} | {cells} |")
    lines += [
        "",
        *(
            f"- {n}: a follow-up sent 1.5 s after a first exchange of {statistics.mean(costs[n]['follow_prompt']):.0f} "
            f"prompt tokens: TTFT median {statistics.median(costs[n]['follow_ttft']):.3f} s, max "
            f"{max(costs[n]['follow_ttft']):.3f} s"
            for n in names
        ),
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--document-words", type=int, default=1800)
    parser.add_argument("--words", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--llama-python", default=None, help="a Python with llama-cpp-python[server] installed, for (d)"
    )
    parser.add_argument(
        "--modes",
        default="a,b,c,d,concurrency,archive",
        help="which of a, b, c, d, the 4-client check and the archive costs to run",
    )
    parser.add_argument(
        "--baseline", default=None, help="another kvdb source tree to run (a) and the archive costs from, side by side"
    )
    parser.add_argument("--baseline-label", default=None, help="what the baseline is (a commit), for the results")
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    modes = set(args.modes.split(","))
    from kvdb.model import source

    dialogues = conversations(args.conversations, args.turns, args.document_words, args.words)
    env = dict(os.environ)
    runs: dict[str, list[list[dict]]] = {}
    archive_costs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:

        def start_kvdb(name: str, source: str | None = None) -> Server:
            here = dict(env, PYTHONPATH=f"{source}{os.pathsep}{shim(source, folder)}") if source else env
            return Server([str(KVDB), "--db", str(Path(folder) / f"{name}.duckdb"), "serve", "--port", "{port}"], here)

        plans = [
            ("(a) kvdb", start_kvdb("a"), False),
            *([("(a0) kvdb before", start_kvdb("a0", args.baseline), False)] if args.baseline else []),
            ("(b) kvdb restarted", start_kvdb("b"), True),
            ("(c) no reuse", Server([sys.executable, "-c", STOCK, "{port}"], env), False),
        ]
        if args.llama_python:
            gguf = str(source.embedded_gguf())
            llama = [
                args.llama_python,
                "-m",
                "llama_cpp.server",
                "--model",
                gguf,
                "--port",
                "{port}",
                "--n_ctx",
                "8192",
                "--n_threads",
                str(os.cpu_count()),
            ]
            plans += [
                ("(d) llama.cpp", Server(llama, env, health="/v1/models"), False),
                ("(d) llama.cpp restarted", Server(llama, env, health="/v1/models"), True),
            ]
        for name, server, restart in [p for p in plans if p[0][1] in modes]:
            server.start()
            try:
                runs[name] = replay(server, dialogues, args.max_tokens, restart)
            finally:
                server.stop()
            print(f"{name}:", *summarise({name: runs[name]}, args.turns), sep="\n", file=sys.stderr, flush=True)
        for name, source in (
            [("(a) kvdb", None), *([("(a0) kvdb before", args.baseline)] if args.baseline else [])]
            if "archive" in modes
            else []
        ):
            server = start_kvdb(f"archive-{name[1:3].strip(')')}", source)
            server.start()
            try:
                archive_costs[name] = archiving(server, Path(server.argv[2]), dialogues, args.max_tokens)
            finally:
                server.stop()
            print(f"{name} archive costs:", archive_costs[name], file=sys.stderr, flush=True)
        concurrency = {}
        # four conversations, however many replayed above
        clients = conversations(4, args.turns, args.document_words, args.words)
        # 30 s (the default before), then the default (600 s)
        for timeout in (30, None) if "concurrency" in modes else ():
            concurrent = start_kvdb(f"concurrent-{timeout}")
            if timeout is not None:
                concurrent.argv += ["--queue-timeout", str(timeout)]
            concurrent.start()
            try:
                concurrency[timeout] = concurrent_failures(concurrent, clients, args.max_tokens)
            finally:
                concurrent.stop()
    last = args.turns - 1
    ttft = {n: statistics.median(conv[last]["ttft"] for conv in r) for n, r in runs.items()}
    ratios = [
        f"- turn {args.turns} TTFT ratio, (c) no reuse / {n}: {ttft['(c) no reuse'] / ttft[n]:.1f}x"
        for n in runs
        if n != "(c) no reuse" and "(c) no reuse" in ttft
    ]
    if {"(d) llama.cpp restarted", "(a) kvdb", "(b) kvdb restarted"} <= set(ttft):
        ratios += [
            f"- turn {args.turns} TTFT ratio, (d) llama.cpp restarted "
            f"/ {n}: {ttft['(d) llama.cpp restarted'] / ttft[n]:.1f}x"
            for n in ("(a) kvdb", "(b) kvdb restarted")
        ]
    lines = [
        describe(),
        "",
        f"{args.conversations} conversations x {args.turns} turns: a document of {args.document_words} words, then "
        f"{args.words} words a turn; greedy replies of at most "
        f"{args.max_tokens} tokens; medians over the conversations (cached tokens: their mean). Command: "
        f"`.venv/bin/python benchmarks/serve.py --conversations {args.conversations} --turns {args.turns} "
        f"--document-words {args.document_words} --words {args.words}"
        + (" --llama-python PY" if args.llama_python else "")
        + (" --baseline SRC" if args.baseline else "")
        + (f" --modes {args.modes}`" if args.modes != parser.get_default("modes") else "`")
        + (f"; SRC is a checkout of {args.baseline_label}" if args.baseline_label else ""),
        "",
        *(summarise(runs, args.turns) if runs else []),
        "",
        *(archive_table(archive_costs, args.turns) if archive_costs else []),
        *ratios,
        *(
            f"- {n}: {statistics.mean(r['ready'] for conv in rows for r in conv[1:]):.1f} s from the restart to "
            "ready (model load; kvdb: the journal archived too)"
            for n, rows in runs.items()
            if "restarted" in n and args.turns > 1
        ),
        *(
            f"- 4 concurrent clients against (a), `--queue-timeout {t or '600 (default)'}`: {f} failed of {n} requests"
            + (f" ({', '.join(why)})" if why else "")
            for t, (f, n, why) in concurrency.items()
        ),
        "",
    ]
    title = "kvdb serve: this checkout against a baseline" if args.baseline else "kvdb serve: multi-turn conversations"
    publish(title, lines, append=not args.no_results)


if __name__ == "__main__":
    main()
