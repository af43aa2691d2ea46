"""What `kvdb serve --upstream` adds to each request: time to first token (TTFT) and total time,
direct to an upstream and through the proxy, side by side in one run.

    nice -n 10 .venv/bin/python benchmarks/proxy.py [--requests 24] [--max-tokens 8] [--model M] [--no-results]

The upstream is a `kvdb serve` process on loopback (the embedded model, or ``--model``); the
proxy is a second `kvdb serve --upstream` process in front of it, archiving every exchange into
an archive of its own. Each of ``--requests`` rounds sends four requests with the official
`openai` client: a streamed chat and a whole one, each once direct and once through the proxy,
the order alternating between rounds, and a `GET /v1/models` each way (no model work: what the
relay itself costs, which the generation's spread hides). Every prompt is new (its own question number), so the
upstream computes each one, and every pair is as long. Greedy, ``--max-tokens`` tokens a reply.
TTFT is from the request to the first chunk with content; total, to the stream's end (or the
whole reply). Two rounds of warm-up are not counted. Then the time until the proxy's archive
holds every exchange. Appends a section to benchmarks/RESULTS.md unless ``--no-results``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).parent))
from report import describe, publish
from serve import KVDB, Server

SYSTEM = "You are a concise, friendly assistant. Answer in plain language."
TOPICS = ("harbours", "bridges", "rivers", "lighthouses", "markets", "railways", "gardens", "libraries")


def prompt(round_: int, side: str) -> list[dict]:
    """A new question each time, as long as its pair's (its number and side differ, not its length)."""
    topic = TOPICS[round_ % len(TOPICS)]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question {round_:03d}{side}: name one fact about old {topic}."},
    ]


def timed(client: OpenAI, messages: list[dict], max_tokens: int, stream: bool) -> tuple[float | None, float]:
    """(seconds to the first content, seconds to the end)."""
    began = time.perf_counter()
    if not stream:
        client.chat.completions.create(model="kvdb", messages=messages, max_tokens=max_tokens, temperature=0)
        return None, time.perf_counter() - began
    first = None
    for chunk in client.chat.completions.create(
        model="kvdb", messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - began
    total = time.perf_counter() - began
    return (first if first is not None else total), total


def archived(url: str) -> int:
    with urllib.request.urlopen(f"{url}/api/sessions?versions=1", timeout=30) as response:
        return len(json.loads(response.read())["sessions"])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=int,
        default=24,
        help="rounds of four requests (a streamed and a whole chat, direct and proxied)",
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="the model both servers run (default: the embedded one)")
    parser.add_argument("--no-results", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvdb-proxy-bench-"))
    model = ["--model", args.model] if args.model else []
    env = {k: v for k, v in os.environ.items() if k not in ("KVDB_DB", "KVDB_API_KEY")}
    upstream = Server([str(KVDB), "--db", str(folder / "upstream.duckdb"), "serve", *model, "--port", "{port}"], env)
    proxy = Server(
        [
            str(KVDB),
            "--db",
            str(folder / "proxy.duckdb"),
            "serve",
            *model,
            "--port",
            "{port}",
            "--upstream",
            upstream.url,
        ],
        env,
    )
    samples: dict[tuple[str, str], list[tuple[float | None, float]]] = {
        (path, kind): [] for path in ("direct", "proxied") for kind in ("stream", "whole", "models")
    }
    try:
        upstream.start()
        proxy.start()
        clients = {
            "direct": OpenAI(base_url=upstream.url, api_key="unused", max_retries=0, timeout=600),
            "proxied": OpenAI(base_url=proxy.url, api_key="unused", max_retries=0, timeout=600),
        }
        warm_up = 2
        for round_ in range(args.requests + warm_up):
            order = ("direct", "proxied") if round_ % 2 == 0 else ("proxied", "direct")
            for kind in ("stream", "whole"):
                for path in order:
                    side = ("a" if path == "direct" else "b") + ("s" if kind == "stream" else "w")
                    measured = timed(clients[path], prompt(round_, side), args.max_tokens, kind == "stream")
                    if round_ >= warm_up:
                        samples[(path, kind)].append(measured)
            for path in order:
                began = time.perf_counter()
                clients[path].models.list()
                if round_ >= warm_up:
                    samples[(path, "models")].append((None, time.perf_counter() - began))
        last_reply = time.perf_counter()
        expected = 2 * (args.requests + warm_up)
        while archived(proxy.url.removesuffix("/v1")) < expected and time.perf_counter() - last_reply < 300:
            time.sleep(0.1)
        archive_lag = time.perf_counter() - last_reply
        held = archived(proxy.url.removesuffix("/v1"))
    finally:
        proxy.stop()
        upstream.stop()

    rows = []
    labels = {"stream": "streamed chat", "whole": "whole chat", "models": "GET /v1/models"}
    for kind, metric, index in (
        ("stream", "TTFT", 0),
        ("stream", "total", 1),
        ("whole", "total", 1),
        ("models", "total", 1),
    ):
        direct = [s[index] for s in samples[("direct", kind)]]
        proxied = [s[index] for s in samples[("proxied", kind)]]
        assert all(v is not None for v in direct + proxied)
        d, p = [float(v) for v in direct if v is not None], [float(v) for v in proxied if v is not None]
        added = [b - a for a, b in zip(d, p)]
        label = f"{labels[kind]}, {metric}"
        rows.append(
            f"| {label} | {1000 * statistics.median(d):.1f} / {1000 * quantile(d, 0.95):.1f} | "
            f"{1000 * statistics.median(p):.1f} / {1000 * quantile(p, 0.95):.1f} | "
            f"{1000 * (statistics.median(p) - statistics.median(d)):+.1f} / "
            f"{1000 * (quantile(p, 0.95) - quantile(d, 0.95)):+.1f} | {1000 * statistics.median(added):+.1f} |"
        )
    lines = [
        f"`nice -n 10 .venv/bin/python benchmarks/proxy.py --requests {args.requests} --max-tokens "
        f"{args.max_tokens}{' --model ' + args.model if args.model else ''}`",
        f"({describe()}). Upstream: `kvdb serve` ({args.model or 'the embedded model'}) "
        "on loopback; proxy: `kvdb serve --upstream` on loopback in",
        f"front of it, archiving each exchange. {args.requests} rounds, each "
        "a streamed and a whole chat, direct and proxied (order alternating),",
        f"each prompt new, {args.max_tokens} tokens a reply, greedy, and a GET /v1/models each way; ms, p50 / p95; "
        "the paired column is the median of (proxied - direct) over rounds.",
        "",
        "| request | direct p50 / p95 | proxied p50 / p95 | added p50 / p95 | added, paired median |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"The proxy's archive held {held} of the {expected} exchanges {archive_lag:.1f} "
        "s after the last reply (each archived off the response path).",
    ]
    publish("kvdb serve --upstream: the proxy's added latency", lines, append=not args.no_results)


if __name__ == "__main__":
    main()
