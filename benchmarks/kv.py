"""KV tier benchmark: bytes/token and restore fidelity of residual-VQ presets on the embedded model.

    .venv/bin/python benchmarks/kv.py [--quick] [--no-results] [--eval N] [--no-peers] [--plot PATH]

Calibrates codebooks on one real text (licences/READMEs, ``corpus.real_text``), evaluates on
held-out 1024-token contexts from *other* files of that corpus. Every configuration is measured
through the restore path: codes -> ``quant.decode`` -> ``kv_support.restore_cache`` (a
DynamicCache) -> teacher-forced continuation of the next 128 tokens, compared with the exact
prefill cache. The model's default preset is also measured with its keys sharpened as a restore
decodes them (``Codebooks.sharpened`` by ``presets.key_sharpening``, decision 0029). Bytes are
the fractal-coded code streams as stored (``fractal.encode_blocks``), plus the exact window when
it is stored (fp16), over the context's tokens; codebooks separately and amortised. Writes its
section of benchmarks/RESULTS.md, in place of the last run's.

Also measured, with the same teacher-forcing protocol and metric code: fp16 (the reference), the
paper's two settings (per-head RVQ 256x2 on post-RoPE keys and values, and hybrid keys x4 / values
x2, both with the 4+32 exact window stored in fp16), and transformers' ``QuantizedCache`` with the
quanto and HQQ backends at 4 and 2 bits (peers; skipped with their error if they fail). Draws a
rate-distortion plot, benchmarks/kv_rate_distortion.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_support as KS
from corpus import real_text
from report import describe, publish

from kvdb.codecs import presets as P
from kvdb.codecs import quant as Q
from kvdb.model import capture as C
from kvdb.model import loading as M
from kvdb.model import tokenizer as T
from kvdb.model.source import DEFAULT_MODEL
from kvdb.services import shipped_codebooks as SH

CTX = 1024
CONT = 128  # continuation tokens scored (CONT + 1 fed)
# per-layer allocations from the one-context sensitivity scan in docs/decisions/0010-tier-k-default-preset.md: keys of
# layers 0-5 and values of layers 0-1 barely matter; later layers carry the damage
PER_LAYER = ["k2v1+k4@6-29+v2@2-29", "k3v2+k6@12-29+v4@10-29"]
# the preset of a model nobody measured; the embedded model's own default (presets.MEASURED_PRESETS["compact"],
# from benchmarks/kv_ideas.py's scan, at tag studies-2026-12-06, at 8,000 tokens) is measured beside it
UNIFORM = P.DEFAULT_PRESET
# the paper's settings, expressed with the harness's own codebooks and window policy
PAPER = [
    ("paper: per-head RVQ 256x2 post-RoPE K+V, window stored", "post", "k2v2", "stored", "kv"),
    ("paper: hybrid K x4 / V x2 post-RoPE, window stored", "post", "k4v2", "stored", "kv"),
]
# transformers QuantizedCache peers: (backend, nbits); defaults q_group_size 64, residual_length 128, axis 0
PEERS = [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 2)]
PLOT = Path(__file__).with_name("kv_rate_distortion.png")


def _bits_per_vector(preset: str, kinds: str, layers: int, heads: int, dim: int) -> str:
    """Mean code bits per archived head vector, keys/values (fp16 = 16·dim for a kind kept exact)."""
    alloc = P.head_allocation(preset, layers, heads)
    out = []
    for kind in Q.KINDS:
        if kind in kinds:
            out.append(float(np.mean([sum(np.log2(s) for s in sizes) for layer in alloc[kind] for sizes in layer])))
        else:
            out.append(16.0 * dim)
    return "/".join(f"{b:g}" if float(b).is_integer() else f"{b:.1f}" for b in out)


def _peer_cache(model, prefix, backend: str, nbits: int):
    """Prefill ``prefix`` in one call into a transformers QuantizedCache (the whole prefix is quantized on the
    first update; the full-precision residual buffer only receives later tokens)."""
    from transformers import QuantizedCache

    cache = QuantizedCache(backend=backend, config=model.config, nbits=nbits)
    with torch.no_grad():
        model(torch.as_tensor(np.asarray(prefix, dtype=np.int64)).reshape(1, -1), cache=cache, use_cache=True)
    return cache


# where a point's number goes, the nth close point's at n
_AROUND = [(5, 3), (5, -10), (-13, 3), (-13, -10), (17, 3), (17, -10)]


def _plot(points, fp16_per_token: int, path: Path, default: str) -> None:
    """points: (label, group, all-inclusive B/token, ppl increase %). Each point is numbered, and a key
    beside the axes names it: the kvdb points sit close together, and their labels would overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    style = {
        "kvdb preset": ("o", "tab:blue"),
        "kvdb window variant": ("s", "tab:cyan"),
        "paper setting": ("D", "tab:red"),
        "QuantizedCache peer": ("^", "tab:green"),
        "fp16": ("*", "black"),
    }
    fig = plt.figure(figsize=(15, 8))
    ax = fig.add_axes((0.055, 0.08, 0.55, 0.80))
    key = fig.add_axes((0.63, 0.02, 0.36, 0.96))
    key.axis("off")
    for group, (marker, color) in style.items():
        pts = [p for p in points if p[1] == group]
        if pts:
            ax.scatter(
                [p[2] for p in pts],
                [p[3] for p in pts],
                marker=marker,
                color=color,
                s=60 if group != "fp16" else 140,
                label=group,
                zorder=3,
            )
    numbered = sorted(points, key=lambda p: (p[2], p[3]))
    placed = []  # stagger the numbers of points that sit close together
    rows = [(f"default = {default}", "black"), ("", "black")]
    for n, (label, group, x, y) in enumerate(numbered, 1):
        near = sum(
            abs(np.log10(x / px)) < 0.05 and abs(np.arcsinh(y / 10) - np.arcsinh(py / 10)) < 0.3 for px, py in placed
        )
        placed.append((x, y))
        ax.annotate(
            str(n),
            (x, y),
            textcoords="offset points",
            xytext=_AROUND[near % len(_AROUND)],
            fontsize=7,
            color=style[group][1],
        )
        rows.append((f"{n:>2}  {label}: {fp16_per_token / x:.1f}x, {y:+.1f}%", style[group][1]))
    for i, (text, color) in enumerate(rows):
        key.text(0, 1 - i / max(len(rows), 44), text, fontsize=7, color=color, va="top", family="monospace")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=20, linscale=3)  # linear up to +20%, log beyond: the 2-bit peers sit far above
    top = max(p[3] for p in points)
    ax.set_ylim(-1.5, top * 1.6)
    ax.set_yticks([t for t in (0, 5, 10, 15, 20, 30, 50, 100, 200, 400, 800) if t <= top * 1.6])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("all-inclusive bytes / token (codes + stored window + codebooks over 1e6 tokens; log scale)")
    ax.set_ylabel("perplexity increase vs exact cache (%; linear to 20, log above)")
    sec = ax.secondary_xaxis(
        "top",
        functions=(lambda b: fp16_per_token / np.maximum(b, 1e-9), lambda r: fp16_per_token / np.maximum(r, 1e-9)),
    )
    sec.set_xlabel("compression ratio vs fp16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        f"KV cache rate–distortion, {DEFAULT_MODEL}, held-out 1024-token contexts, 128 teacher-forced tokens",
        fontsize=9,
        x=0.33,
        y=0.99,
    )
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def load_model():
    """(the embedded model, layers, KV heads, head dim), with faiss on one thread: k-means on a
    few thousand points only contends with more."""
    import faiss

    faiss.omp_set_num_threads(1)
    lm = M.load()
    cfg = lm.model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return lm, cfg.num_hidden_layers, cfg.num_key_value_heads, dim


def spaced_starts(ids, first: int, n: int, count: int) -> list[int]:
    """Where ``count`` held-out contexts of ``n`` tokens (each followed by the CONT + 1 scored)
    start: evenly spaced from ``first`` to the end of ``ids``."""
    stride = max(n + CONT + 1, (len(ids) - first - n - CONT - 1) // max(count, 1))
    return [first + i * stride for i in range(count)]


def _captured(model, ids):
    """Pre-RoPE keys and values of one context; cached under $KVBENCH_CACHE (a folder) when set."""
    folder = os.environ.get("KVBENCH_CACHE")
    if folder:
        import hashlib

        path = Path(folder) / (hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()[:24] + ".npz")
        if path.is_file():
            z = np.load(path)
            return z["k"], z["v"]
    k, v = C.capture(model, ids, pre_rope=True)
    if folder:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, k=k, v=v)
    return k, v


# Where the loss at long contexts comes from: the default preset with one part of the cache kept
# exact (label, which positions or kinds or layers stay exact).
DIAGNOSES = [
    ("only the last 1,024 positions quantized", "old"),
    ("the last 1,024 positions exact", "recent"),
    ("keys exact", "keys"),
    ("values exact", "values"),
    ("layers 0-14 exact", "layers:0-15"),
    ("layers 15-29 exact", "layers:15-30"),
]


def _exact_part(kq, vq, kpre, vals, part: str):
    """Copies of the decoded arrays with one part replaced by the exact ones (a DIAGNOSES entry)."""
    kq, vq = kq.copy(), vq.copy()
    n = kq.shape[2]
    if part == "old":
        kq[:, :, : n - 1024], vq[:, :, : n - 1024] = kpre[:, :, : n - 1024], vals[:, :, : n - 1024]
    elif part == "recent":
        kq[:, :, n - 1024 :], vq[:, :, n - 1024 :] = kpre[:, :, n - 1024 :], vals[:, :, n - 1024 :]
    elif part == "keys":
        kq[:] = kpre
    elif part == "values":
        vq[:] = vals
    else:
        lo, hi = map(int, part.split(":")[1].split("-"))
        kq[lo:hi], vq[lo:hi] = kpre[lo:hi], vals[lo:hi]
    return kq, vq


def _exact_pass(model, prefix, cont):
    """The reference: pre-RoPE keys and values of ``prefix`` from one exact prefill, and the
    log-probabilities and argmaxes of ``cont`` teacher-forced through that cache."""
    exact = M.new_cache(model)
    parts = list(C.capture_chunks(model, prefix, pre_rope=True, cache=exact))
    kpre = np.concatenate([p[1] for p in parts], axis=2)
    vals = np.concatenate([p[2] for p in parts], axis=2)
    lp, am = C.teacher_forced(model, exact, cont)
    return kpre, vals, lp, am


def _long_contexts(model, ids, lengths, n_long, calib_end, books, default, sharpen, peers, check_held_out):
    """Table rows at long contexts: the model's default preset (trained and shipped; as trained
    and, where the model has a factor, with keys sharpened as a restore decodes them) and its
    diagnoses, the uniform preset, and the peers, by the same teacher-forced protocol as the
    1,024-token table."""
    rows = []
    for n in lengths:
        starts = spaced_starts(ids, calib_end + 20_000, n, n_long)
        assert starts[-1] + n + CONT + 1 <= len(ids), f"corpus too short for {n_long} contexts of {n}"
        found = {}  # label -> (nll list, nll_exact list, agreement list)

        def add(label, lp, am, lp_exact, am_exact, found=found):
            r = found.setdefault(label, ([], [], []))
            r[0].append(-lp)
            r[1].append(-lp_exact)
            r[2].append(am == am_exact)

        for s in starts:
            check_held_out(s, n)
            prefix, cont = ids[s : s + n], ids[s + n : s + n + CONT + 1]
            kpre, vals, lp_exact, am_exact = _exact_pass(model, prefix, cont)

            def restored(label, k, v, prefix=prefix, cont=cont, lp_exact=lp_exact, am_exact=am_exact):
                lp, am = C.teacher_forced(
                    model, KS.restore_cache(model, prefix, k, v, pre_rope=True, window="recompute"), cont
                )
                add(label, lp, am, lp_exact, am_exact)

            for which, preset in (("pre", default), ("shipped", default), ("pre", UNIFORM)):
                cb = KS.truncate(books[which], preset)
                codes = Q.encode(cb, kpre, vals)
                kq, vq = Q.decode(cb, codes)
                if preset == default and sharpen != 1.0:
                    restored(f"{which} {preset}, keys sharpened x{sharpen}", *Q.decode(cb.sharpened(sharpen), codes))
                diagnosed = which == "pre" and preset == default
                variants = [("", None)] + ([(f", {label}", part) for label, part in DIAGNOSES] if diagnosed else [])
                for suffix, part in variants:
                    restored(
                        f"{which} {preset}{suffix}",
                        *((kq.copy(), vq.copy()) if part is None else _exact_part(kq, vq, kpre, vals, part)),
                    )
                del kq, vq
            for backend, nbits in peers:
                label = f"QuantizedCache {backend} {nbits}-bit"
                try:
                    lp, am = C.teacher_forced(model, _peer_cache(model, prefix, backend, nbits), cont)
                except Exception as exc:  # noqa: BLE001 -- reported in the table, as in the 1,024-token one
                    print(f"{label} at {n} failed: {exc}", flush=True)
                    continue
                add(label, lp, am, lp_exact, am_exact)
            print(f"long context of {n} at {s} done", flush=True)
        for label, (nll, nll_e, agree) in found.items():
            ratio = float(np.exp(np.concatenate(nll).mean() - np.concatenate(nll_e).mean()))
            per = [float(np.exp(a.mean() - b.mean())) for a, b in zip(nll, nll_e)]
            rows.append(
                f"| {n:,} | {label} | {ratio:.4f} | {min(per):.3f}–{max(per):.3f} | "
                f"{float(np.concatenate(agree).mean()):.3f} | {len(nll)} |"
            )
        rows.append(f"| {n:,} | (offsets) | {starts} | | | |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="2 calibration contexts, 1 eval context, few presets; prints only"
    )
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--calib", type=int, default=8, help="calibration contexts of 1024 tokens")
    ap.add_argument(
        "--eval", type=int, default=4, help="held-out contexts of 1024 + 129 tokens (at least 4 for results)"
    )
    ap.add_argument("--no-peers", action="store_true", help="skip the transformers QuantizedCache (quanto, HQQ) peers")
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"rate-distortion PNG (default {PLOT.name}; not drawn with --quick unless given)",
    )
    ap.add_argument("--x1024", action="store_true", help="also train and measure 1024-entry key codebooks")
    ap.add_argument(
        "--long",
        default="4096,8000",
        help="long context lengths for the default preset, its diagnoses and the peers ('' skips)",
    )
    ap.add_argument("--long-eval", type=int, default=2, help="held-out contexts per long length")
    args = ap.parse_args()
    n_calib, n_eval = (2, 1) if args.quick else (args.calib, args.eval)
    t_all = time.perf_counter()
    lm, L, H, D = load_model()
    model = lm.model
    fp16_per_token = L * 2 * H * D * 2

    text = real_text(600_000)
    ids = np.asarray(T.encode(lm.tokenizer, text), dtype=np.int64)
    calib_ids = ids[: n_calib * CTX]
    # held-out: contexts far past the calibration text (different files), spaced apart
    eval_starts = spaced_starts(ids, max(len(calib_ids) + 20_000, len(ids) // 3), CTX, n_eval)
    assert eval_starts[-1] + CTX + CONT + 1 <= len(ids), "corpus too short"
    print(
        f"corpus {len(text):,} chars, {len(ids):,} tokens; calib {len(calib_ids)} tokens; eval starts {eval_starts}",
        flush=True,
    )
    shipped_text = SH.CALIBRATION.read_text(encoding="utf-8")

    def check_held_out(s: int, n: int) -> None:
        """The shipped codebooks' text must not hold what they are scored on."""
        held_out = T.decode(lm.tokenizer, ids[s : s + n + CONT + 1].tolist())
        shared = [
            held_out[i : i + 80]
            for i in range(0, max(len(held_out) - 80, 1), 40)
            if held_out[i : i + 80] in shipped_text
        ]
        assert not shared, f"held-out context at {s} shares text with kvdb/data/calibration.txt: {shared[0]!r}"

    for s in eval_starts:
        check_held_out(s, CTX)

    # -- calibration vectors (pre-RoPE keys; post-RoPE keys by re-rotation, exact) --------------
    t = time.perf_counter()
    ck, cv, ckpost = [], [], []
    for c in range(n_calib):
        k, v = _captured(model, calib_ids[c * CTX : (c + 1) * CTX])
        # the sink positions are recomputed on restore, never quantized: keep their outliers out
        ck.append(k[:, :, C.SINKS :])
        cv.append(v[:, :, C.SINKS :])
        ckpost.append(C.apply_rope(model, k)[:, :, C.SINKS :])
    ck, cv, ckpost = (np.concatenate(a, axis=2) for a in (ck, cv, ckpost))
    t_capture = time.perf_counter() - t
    print(f"captured calibration in {t_capture:.0f} s", flush=True)

    default = P.resolve("compact", lm.identity.weights_hash)  # the preset the shipped figures below are of
    sharpen = P.key_sharpening(lm.identity.weights_hash)  # what a restore decodes the model's keys with (decision 0029)
    kmax, vmax = 16, 4  # every preset measured, the model's default too, is a prefix of these stages
    t = time.perf_counter()
    pre = Q.train({"k": ck, "v": cv}, f"k{kmax}v{vmax}", pre_rope=True, meta={"calib_tokens": int(ck.shape[2])})
    t_train_pre = time.perf_counter() - t
    print(f"trained pre-RoPE k{kmax}v{vmax} in {t_train_pre:.0f} s", flush=True)
    t = time.perf_counter()
    post_k = Q.train({"k": ckpost}, "k6v0", pre_rope=False)
    post = Q.Codebooks(L, H, D, False, {"k": post_k.books["k"], "v": pre.books["v"]}, f"k6v{vmax}")
    t_train_post = time.perf_counter() - t
    print(f"trained post-RoPE keys in {t_train_post:.0f} s", flush=True)
    big = None
    if args.x1024:
        t = time.perf_counter()
        bk = Q.train({"k": ck}, "k3x1024v0", pre_rope=True)
        big = Q.Codebooks(L, H, D, True, {"k": bk.books["k"], "v": pre.books["v"]}, f"k3x1024v{vmax}")
        print(f"trained 1024-entry keys in {time.perf_counter() - t:.0f} s", flush=True)
    blob = pre.to_bytes()
    assert Q.Codebooks.from_bytes(blob).to_bytes() == blob
    t = time.perf_counter()
    # what `--keep kv` uses on a fresh archive: trained on kvdb/data/calibration.txt
    shipped_books = SH.build(lm, preset=default)[1]
    t_shipped = time.perf_counter() - t
    print(f"shipped codebooks ready in {t_shipped:.0f} s", flush=True)
    del ck, cv, ckpost

    # -- configurations ---------------------------------------------------------------------------
    # (label, codebook set, preset, window policy, what is quantized)
    if args.quick:
        presets = ["k2v1", "k4v2"]
    else:
        presets = ["k2v1", "k3v1", "k3v2", "k4v1", "k4v2", "k4v3", "k6v3", "k6v4", *PER_LAYER] + (
            [default] if default != UNIFORM else []
        )
    configs = [(f"pre {p}", "pre", p, "recompute", "kv") for p in presets]
    configs += [
        (f"shipped {p} (packaged calibration text)", "shipped", p, "recompute", "kv")
        for p in ([default] if args.quick else [default, "k2v2", "k2v1"])
    ]
    sharpened = (
        [
            (f"pre {default}, keys sharpened x{sharpen}", "pre", default, "recompute", "kv"),
            (
                f"shipped {default} (packaged calibration text), keys sharpened x{sharpen}",
                "shipped",
                default,
                "recompute",
                "kv",
            ),
        ]
        if sharpen != 1.0
        else []
    )
    configs += sharpened
    factors = {c[0]: sharpen for c in sharpened}
    configs += [
        (f"post {p}", "post", p, "recompute", "kv") for p in (["k4v2"] if args.quick else ["k2v1", "k4v2", "k6v3"])
    ]
    base = "k4v2"
    configs += [
        (f"pre {base} window fp16 stored", "pre", base, "stored", "kv"),
        (f"pre {base} sinks recomputed, recent quantized", "pre", base, "quantized", "kv"),
        (f"pre {base} nothing exact", "pre", base, "none", "kv"),
    ]
    if not args.quick:
        configs += [
            ("pre k4 keys only (values exact fp16)", "pre", "k4v2", "recompute", "k"),
            ("pre v2 values only (keys exact fp16)", "pre", "k4v2", "recompute", "v"),
        ]
    configs += PAPER
    if big is not None:
        configs += [(f"pre {p}", "big", p, "recompute", "kv") for p in ("k2x1024v1", "k3x1024v2")]
    peers = [] if args.no_peers else list(PEERS)
    peer_rows = {
        f"QuantizedCache {b} {n}-bit": {
            "nll": [],
            "agree": [],
            "restore_s": [],
            "backend": b,
            "nbits": n,
            "error": None,
        }
        for b, n in peers
    }
    books = {"pre": pre, "post": post, "big": big, "shipped": shipped_books}

    rows = {
        c[0]: {"nll": [], "nll_exact": [], "agree": [], "bytes": [], "restore_s": [], "encode_s": []} for c in configs
    }
    for e, s in enumerate(eval_starts):
        prefix, cont = ids[s : s + CTX], ids[s + CTX : s + CTX + CONT + 1]
        kpre, vals, lp_exact, am_exact = _exact_pass(model, prefix, cont)
        kpost = C.apply_rope(model, kpre)
        for plabel, pr in peer_rows.items():
            if pr["error"]:
                continue
            try:
                t = time.perf_counter()
                cache = _peer_cache(model, prefix, pr["backend"], pr["nbits"])
                pr["restore_s"].append(time.perf_counter() - t)
                lp, am = C.teacher_forced(model, cache, cont)
                del cache
            except Exception as exc:  # noqa: BLE001
                # a peer that does not install or run on this machine is reported and skipped
                pr["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print(f"{plabel} failed: {pr['error']}", flush=True)
                continue
            pr["nll"].append(-lp)
            pr["agree"].append(am == am_exact)
        encoded = {}
        for name, cb in books.items():
            if cb is None:
                continue
            t = time.perf_counter()
            encoded[name] = Q.encode(cb, kpre if cb.pre_rope else kpost, vals)
            encoded[name + ":s"] = time.perf_counter() - t
        for label, which, preset, window, kinds in configs:
            cb = KS.truncate(books[which], preset)
            kc, vc = encoded[which]
            kc, vc = kc[:, :, : cb.max_stages("k")], vc[:, :, : cb.max_stages("v")]
            decoding = cb.sharpened(factors.get(label, 1.0))  # folded once per codebook set in a restore, not timed
            t = time.perf_counter()
            kq, vq = Q.decode(decoding, (kc, vc))
            if "k" not in kinds:
                kq = kpre if cb.pre_rope else kpost
            if "v" not in kinds:
                vq = vals
            if window == "stored":
                kq, vq = kq.copy(), vq.copy()
                ke = kpre if cb.pre_rope else kpost
                for sl in (slice(0, C.SINKS), slice(CTX - C.RECENT, CTX)):
                    kq[:, :, sl], vq[:, :, sl] = ke[:, :, sl], vals[:, :, sl]
                cache = KS.restore_cache(model, prefix, kq, vq, pre_rope=cb.pre_rope, window="none")
            else:
                cache = KS.restore_cache(model, prefix, kq, vq, pre_rope=cb.pre_rope, window=window)
            restore_s = time.perf_counter() - t
            lp, am = C.teacher_forced(model, cache, cont)
            del cache
            # bytes as stored
            if window == "stored":
                code_b = KS.stored_code_bytes(cb, (kc[..., : CTX - C.RECENT], vc[..., : CTX - C.RECENT]), start=C.SINKS)
                win_b = (C.SINKS + C.RECENT) * fp16_per_token
            elif window == "none":
                code_b, win_b = KS.stored_code_bytes(cb, (kc, vc)), 0
            else:  # sinks recomputed from tier-T tokens; codes kept for every later position
                code_b, win_b = KS.stored_code_bytes(cb, (kc, vc), start=C.SINKS), 0
            if kinds != "kv":  # the exact kind would be stored in fp16
                only = Q.Codebooks(
                    L,
                    H,
                    D,
                    cb.pre_rope,
                    {kk: (cb.books[kk] if kk in kinds else [[] for _ in range(L)]) for kk in Q.KINDS},
                    depths={kk: d for kk, d in cb.depths.items() if kk in kinds},
                )
                code_b = KS.stored_code_bytes(only, (kc, vc), start=C.SINKS) + (CTX - C.SINKS) * fp16_per_token // 2
            r = rows[label]
            r["nll"].append(-lp)
            r["nll_exact"].append(-lp_exact)
            r["agree"].append(am == am_exact)
            r["bytes"].append((code_b + win_b) / CTX)
            r["restore_s"].append(restore_s)
            r["encode_s"].append(encoded[which + ":s"])
            r["codebook_bytes"] = cb.nbytes
            r["preset"], r["window"] = preset, window
        print(f"eval context {e + 1}/{n_eval} done ({time.perf_counter() - t_all:.0f} s)", flush=True)

    # -- table --------------------------------------------------------------------------------------
    header = (
        "| configuration | window | bits / archived vector (K/V) | B/token (codes+window) | ratio vs fp16 | codebooks "
        "MB (fp16) | all-incl. B/token @1e6 tok | ratio incl. codebooks @1e5 tok | @1e6 tok | ppl (pooled) | ppl "
        "increase | ppl ratio (pooled) | per-context ppl ratio min–max | top-1 agreement | restore s (median) |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    nll_exact_all = np.concatenate(rows[configs[0][0]]["nll_exact"])
    ppl_exact = float(np.exp(nll_exact_all.mean()))
    lines.append(
        f"| fp16 (exact cache, reference) | — | {16 * D}/{16 * D} | {fp16_per_token:,.1f} | 1.0x | — | "
        f"{fp16_per_token:,.1f} | 1.0x | 1.0x | {ppl_exact:.2f} | +0.0% | 1.0000 | 1.000–1.000 | 1.000 | — |"
    )
    points = [("fp16", "fp16", float(fp16_per_token), 0.0)]
    for label, _which, preset, window_, kinds in configs:
        r = rows[label]
        nll, nll_e = np.concatenate(r["nll"]), np.concatenate(r["nll_exact"])
        ratio_ppl = float(np.exp(nll.mean() - nll_e.mean()))
        per_ctx = [float(np.exp(a.mean() - b.mean())) for a, b in zip(r["nll"], r["nll_exact"])]
        agree = float(np.concatenate(r["agree"]).mean())
        bpt = float(np.median(r["bytes"]))
        cbb = r["codebook_bytes"]
        allin = bpt + cbb / 1e6
        win = {
            "recompute": "sinks+recent recomputed",
            "stored": "36 tok fp16 stored",
            "quantized": "sinks recomputed, recent VQ",
            "none": "none (all VQ)",
        }[r["window"]]
        lines.append(
            f"| {label} | {win} | {_bits_per_vector(preset, kinds, L, H, D)} | {bpt:,.1f} | "
            f"{fp16_per_token / bpt:.1f}x | {cbb / 1e6:.2f} | {allin:,.1f} | {fp16_per_token / (bpt + cbb / 1e5):.1f}x "
            f"| {fp16_per_token / allin:.1f}x | {ppl_exact * ratio_ppl:.2f} | {100 * (ratio_ppl - 1):+.1f}% | "
            f"{ratio_ppl:.4f} | {min(per_ctx):.3f}–{max(per_ctx):.3f} "
            f"| {agree:.3f} | {np.median(r['restore_s']):.2f} |"
        )
        if label.startswith("paper"):
            group, short = "paper setting", ("paper RVQ 256x2" if preset == "k2v2" else "paper hybrid K4/V2")
        elif kinds != "kv" or window_ in ("stored", "quantized", "none"):
            group, short = "kvdb window variant", label
        else:
            group, short = "kvdb preset", label
        if kinds == "kv":  # the one-kind rows sit at ~2x and would squash the axis; they stay in the table
            points.append(
                (
                    short.replace(default, "default").replace(" (packaged calibration text)", ""),
                    group,
                    allin,
                    100 * (ratio_ppl - 1),
                )
            )
    peer_failures = []
    for plabel, pr in peer_rows.items():
        if pr["error"] or not pr["nll"]:
            peer_failures.append(f"{plabel}: {pr['error'] or 'no contexts measured'}")
            continue
        g, nb = 64, pr["nbits"]  # QuantizedCache default q_group_size; one group = one 64-dim head vector here
        bits_vec = nb * D + 2 * 16 * (D / g)  # codes + fp16 scale and zero-point per group
        bpt = L * 2 * H * bits_vec / 8  # residual_length tokens in full precision: 0 of the archived prefix (see notes)
        nll = np.concatenate(pr["nll"])
        ratio_ppl = float(np.exp(nll.mean() - nll_exact_all.mean()))
        per_ctx = [float(np.exp(a.mean() - b.mean())) for a, b in zip(pr["nll"], rows[configs[0][0]]["nll_exact"])]
        agree = float(np.concatenate(pr["agree"]).mean())
        lines.append(
            f"| {plabel} (group {g}) | none (all quantized) | {bits_vec:g}/{bits_vec:g} | {bpt:,.1f} | "
            f"{fp16_per_token / bpt:.1f}x | — | {bpt:,.1f} | {fp16_per_token / bpt:.1f}x | "
            f"{fp16_per_token / bpt:.1f}x | {ppl_exact * ratio_ppl:.2f} | {100 * (ratio_ppl - 1):+.1f}% | "
            f"{ratio_ppl:.4f} | {min(per_ctx):.3f}–{max(per_ctx):.3f} | {agree:.3f} "
            f"| {np.median(pr['restore_s']):.2f} |"
        )
        points.append((f"{pr['backend']} {nb}-bit", "QuantizedCache peer", bpt, 100 * (ratio_ppl - 1)))
    lengths = [int(x) for x in args.long.split(",") if x.strip()]
    long_rows = (
        _long_contexts(
            model,
            ids,
            lengths,
            1 if args.quick else args.long_eval,
            len(calib_ids),
            books,
            default,
            sharpen,
            [] if args.no_peers else PEERS,
            check_held_out,
        )
        if lengths
        else []
    )
    plot_path = args.plot if args.plot is not None else (None if args.quick else PLOT)
    if plot_path is not None:
        _plot(points, fp16_per_token, plot_path, default)
        print(f"wrote {plot_path}", flush=True)
    total = time.perf_counter() - t_all
    section = [
        f"Run at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. `.venv/bin/python benchmarks/kv.py "
        f"{' '.join(sys.argv[1:])}` — "
        f"{describe(f'torch {torch.__version__}', f'torch threads {torch.get_num_threads()}')}.",
        "",
        f"Model {DEFAULT_MODEL} ({L} layers, {H} KV heads, head_dim {D}; fp16 KV = {fp16_per_token:,} B/token). "
        f"Codebooks calibrated on the first {n_calib * CTX:,} tokens of `corpus.real_text` ({n_calib} contexts of "
        f"{CTX}); faiss k-means, 12 iterations, greedy encoding, centroids stored fp16, sink positions left out of "
        f"training. Evaluated on {n_eval} held-out contexts of {CTX} tokens (token offsets {eval_starts}, other "
        f"files), each followed by {CONT} teacher-forced tokens; exact-prefill perplexity on them {ppl_exact:.2f}. "
        "B/token = fractal-coded code streams as stored (block headers/CRC included) + exact window if stored, / "
        f"{CTX} tokens (median over contexts; identical for every context). Recomputed windows cost no bytes: they are "
        "recomputed from the token tier (~1.95 B/token, stored by every archive anyway). ppl ratio = exp(mean NLL "
        f"restored − mean NLL exact) pooled over all scored tokens; top-1 = share of the {CONT + 1} positions whose "
        "argmax equals the exact cache's. Restore s = decode + DynamicCache build + window recompute. Shipped rows: "
        "kvdb's own codebooks (`kvdb.services.shipped_codebooks`, what `--keep kv` uses on an archive with none), "
        "trained on `kvdb/data/calibration.txt` (CC0 legal text and two chapters of the Vim manual; no 80-character "
        f"span of it occurs in the held-out contexts), ready in {t_shipped:.0f} s (0 when this machine had built "
        f"them). Calibration capture {t_capture:.0f} s{' (KVBENCH_CACHE)' if os.environ.get('KVBENCH_CACHE') else ''}, "
        f"training (pre-RoPE k{kmax}v{vmax}) {t_train_pre:.0f} s, post-RoPE keys {t_train_post:.0f} s. Presets with "
        "fewer stages are prefixes of the trained quantizer (stages nest). Paper reference (GPT-2, simulated "
        "quantization, window and codebooks excluded): 54x at +15.0% ppl, 36x at +11.2%.",
        "",
        (
            f"Every row uses the same protocol: the {CTX}-token context is put in a cache, then the same {CONT + 1} "
            "tokens are fed in one teacher-forced call and compared with the exact (fp32) prefill cache by the same "
            f"code (`capture.teacher_forced`). Bits / archived vector = code bits per {D}-dim head vector, "
            f"keys/values, mean over layers ({16 * D} = kept in fp16); all-inclusive B/token = codes + stored window + "
            "codebooks amortised over 1e6 tokens (recomputed windows additionally need the token tier, ~1.95 B/token). "
            "ppl increase = ppl ratio − 1. Paper settings: the harness's post-RoPE codebooks truncated to k2v2 "
            "(256x2 per head, keys and values) and k4v2 (hybrid keys x4 / values x2), with the 4 sink + 32 recent "
            "positions stored exactly in fp16 and counted in the bytes. QuantizedCache peers: transformers "
            f"{transformers.__version__} `QuantizedCache(backend, config, nbits)` with its defaults (q_group_size 64, "
            f"axis 0, residual_length 128), optimum-quanto {_version('optimum-quanto')}, hqq {_version('hqq')}; the "
            f"{CTX}-token prefix is prefilled in one call, which quantizes all of it on the first update (the "
            "full-precision residual buffer only takes later tokens, so it holds 0 archived tokens), then the "
            f"{CONT + 1} tokens are teacher-forced through that cache. With axis 0 and group 64 every group is one "
            f"{D}-dim head vector of one token, so bytes/token = layers·2·kv_heads·(nbits·{D} + 2·16)/8 (nbits "
            "per element plus a scale and a zero-point per group, counted as fp16; the cache holds them in fp32 in "
            f"memory, which would add 32 bits per vector); no codebooks. Plot: `{(plot_path or PLOT).name}` (x "
            "all-inclusive B/token, log; y ppl increase %; the one-kind rows are left out)."
            + (f" Peers that failed: {'; '.join(peer_failures)}." if peer_failures else "")
        ),
        "",
        *lines,
        "",
        *(
            [
                f"Long contexts: {args.long_eval} held-out contexts per length, past the calibration text, each "
                f"followed by the same {CONT + 1} teacher-forced tokens; window recomputed; the trained (`pre`) and "
                f"shipped codebooks at the model's default {default}, and `pre` at {UNIFORM} (every layer alike). "
                "The diagnoses keep one part of the `pre` cache exact to show where the loss comes from.",
                "",
                "| context tokens | configuration | ppl ratio (pooled) "
                "| per-context min–max | top-1 agreement | contexts |",
                "|---:|---|---:|---:|---:|---:|",
                *long_rows,
                "",
            ]
            if long_rows
            else []
        ),
        f"Total benchmark time {total:.0f} s.",
        "",
    ]
    publish(
        "KV tier: residual VQ presets through the restore path", section, append=not (args.quick or args.no_results)
    )


if __name__ == "__main__":
    main()
