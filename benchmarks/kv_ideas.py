"""Issue 16's ideas for a better tier K curve, each measured on kv.py's held-out protocol, and
where the loss at 8,000 tokens comes from.

    .venv/bin/python benchmarks/kv_ideas.py [--no-results]

The protocol is kv.py's: codebooks calibrated on the first 8 x 1,024 tokens of
``corpus.real_text`` (sinks left out), scored on the same held-out contexts (4 of 1,024 tokens
and 2 of 8,000, at kv.py's offsets), each followed by 128 teacher-forced tokens through
``capture.teacher_forced`` with the window recomputed, against the exact prefill cache. One
pre-RoPE k16v4 training serves every preset (stages nest). Bytes are the code streams as stored
(``code_layout.stored_code_bytes``) plus the codebooks amortised over 1e6 tokens.

1. **Where the loss at 8,000 tokens comes from**: k4v3 everywhere, the keys of one layer exact;
   then one head at a time of the four layers that matter most.
2. **Bits by importance, per layer and head**: presets built from that scan (deeper key codes
   on the layers or only the heads found, fewer elsewhere), SmolLM2's default among them
   (``presets.resolve("compact", ...)``); the default and k4v3 also on two more 8,000-token contexts that
   no choice here looked at (validation).
3. **Bits by importance, per position**: each position's attention mass received in the ingest
   pass (every later query, head and layer); the upper half gets k6v4, the lower k2v2, against
   k4v3 for every position (the same bytes). At 1,024 tokens only (eager attention).
4. **Layer 0 from the tokens**: in a Llama-style model layer 0's keys and values are a function
   of the token alone; computed from the embedding, checked against the captured ones, and
   their bytes left out.
5. **A rotation before VQ**: a random orthogonal rotation per (layer, head, kind), k4v3 trained
   and scored in the rotated space.
6. **Cross-layer prediction**: the share of the variance of layer l's keys (values) that a
   least-squares linear map from layer l-1's exact ones predicts (the best case); then, on the
   protocol, closed-loop prediction: from layer 1 on, each layer's keys are coded as the residual
   of an fp16 affine map of the *decoded* previous layer's keys (every head's, side by side), and
   its values of the decoded previous layer's values, or of those and this layer's decoded keys;
   each residual gets its own k3v3 codebooks. The maps' bytes are counted, and the time of their
   products at 8,000 positions is set beside the restore's.
7. **Entropy coding of the code indices**: cross-entropy of the held-out k4v3 codes under
   tables counted on the calibration codes (add-1/2 smoothing toward the order-0 table), the
   tables' bytes (2 per count) counted.
8. **How much the codebooks' training moves the figures**: k4v3 trained again with two other
   k-means seeds, and on the next 8,192 tokens of the corpus instead, all scored alike.
9. **Sharpened keys** (``Codebooks.sharpened``, decision 0029): the default preset's keys moved
   1.05 and 1.1 times further from each head's centre, in every head or only the four found in
   1.; with the KL divergence from the exact cache's next-token distributions beside the
   perplexity, and the same move on exact keys as a control (what it does to the model itself).
10. **The sharpening factor by preset**: KL divergence from the exact cache for factors 1 to 1.15
   on presets from k2v1 to k8v4: whether one factor per model serves every preset.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_support as KS
from corpus import real_text
from kv import CONT, CTX, _exact_pass, load_model, spaced_starts
from report import describe, publish

from kvdb.codecs import presets as P
from kvdb.codecs import quant as Q
from kvdb.model import capture as C
from kvdb.model import tokenizer as T

BASE = "k4v3"
LONG = 8000
VALIDATION = (54_000, 110_000)  # 8,000-token contexts clear of every other context here
PREDICTED_STAGES = 3  # the cross-layer prediction's residual codebooks: k3v3


def _held_out(ids: np.ndarray, calib_end: int) -> list[tuple[int, int]]:
    """kv.py's offsets: 4 contexts of 1,024 past a third of the corpus, 2 of 8,000 past the calibration."""
    short = spaced_starts(ids, max(calib_end + 20_000, len(ids) // 3), CTX, 4)
    return [(s, CTX) for s in short] + [(s, LONG) for s in spaced_starts(ids, calib_end + 20_000, LONG, 2)]


def _calibration(model, ids) -> tuple[np.ndarray, np.ndarray]:
    """Pre-RoPE keys and values of ``ids`` as contexts of 1,024 tokens, sinks left out (kv.py's calibration)."""
    parts = [C.capture(model, ids[at : at + CTX], pre_rope=True) for at in range(0, len(ids), CTX)]
    return tuple(np.concatenate([p[i][:, :, C.SINKS :] for p in parts], 2) for i in (0, 1))


def _layer0_from_tokens(model, ids) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's pre-RoPE keys and values of each token alone: embedding, norm, projections."""
    layer = model.model.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(torch.as_tensor(np.asarray(ids, np.int64))))
        heads, dim = model.config.num_key_value_heads, attn.head_dim
        k = attn.k_proj(x).view(len(ids), heads, dim).transpose(0, 1)
        v = attn.v_proj(x).view(len(ids), heads, dim).transpose(0, 1)
    return k.float().numpy(), v.float().numpy()


def _attention_mass(model, ids) -> np.ndarray:
    """Attention each position receives in one prefill of ``ids``, summed over queries, heads and layers."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.as_tensor(np.asarray(ids, np.int64))[None], output_attentions=True)
        return sum(a[0].sum(dim=(0, 1)).float().numpy() for a in out.attentions)
    finally:
        model.set_attn_implementation("sdpa")


def _side_by_side(*layers: np.ndarray) -> np.ndarray:
    """``[n, sum of heads * dim, + 1]``: every head's vector of each ``[heads, n, dim]`` layer side by side, then a 1."""
    n = layers[0].shape[1]
    return np.hstack([x.transpose(1, 0, 2).reshape(n, -1) for x in layers] + [np.ones((n, 1), np.float32)])


def _predict(w: np.ndarray | None, *sources: np.ndarray) -> np.ndarray | float:
    """The affine prediction ``[heads, n, dim]`` of a layer from ``sources`` (0 where there is no map)."""
    if w is None:
        return 0.0
    y = _side_by_side(*sources) @ w
    return y.reshape(len(y), -1, sources[0].shape[2]).transpose(1, 0, 2)


def _fit(sources: tuple, target: np.ndarray) -> np.ndarray | None:
    """The least-squares affine map from ``sources`` to ``target`` (``[heads, n, dim]`` each), rounded to fp16 as stored."""
    if not sources:
        return None
    y = target.transpose(1, 0, 2).reshape(target.shape[1], -1)
    return np.linalg.lstsq(_side_by_side(*sources), y, rcond=None)[0].astype(np.float16).astype(np.float32)


def _one_layer(kind: str, x: np.ndarray, stages: int, seed: int) -> Q.Codebooks:
    """k``stages`` (or v) RVQ codebooks of one layer's ``[heads, n, dim]`` vectors, trained as every set here is."""
    return Q.train({kind: x[None]}, f"k{stages}v0" if kind == "k" else f"k0v{stages}", pre_rope=True, seed=seed)


def _quantized(cb: Q.Codebooks, kind: str, x: np.ndarray) -> np.ndarray:
    """``x`` ``[heads, n, dim]`` through one layer's codebooks of one kind."""
    other = np.zeros_like(x[None])
    pair = (x[None], other) if kind == "k" else (other, x[None])
    return Q.decode(cb, Q.encode(cb, *pair))[Q.KINDS.index(kind)][0]


def _sources(kind: str, layer: int, k_hat: np.ndarray, v_hat: np.ndarray, values_from_keys: bool) -> tuple:
    """What predicts a layer of ``kind``: the decoded previous layer of that kind (layer 0 has none)
    and, for values with ``values_from_keys``, this layer's decoded keys."""
    previous = () if layer == 0 else ((k_hat if kind == "k" else v_hat)[layer - 1],)
    return ((k_hat[layer],) if kind == "v" and values_from_keys else ()) + previous


def _predicted(keys: np.ndarray, values: np.ndarray, values_from_keys: bool, trained: list | None = None) -> tuple[list, np.ndarray, np.ndarray]:
    """Closed-loop cross-layer prediction of ``[layers, heads, n, dim]`` keys and values, layer by
    layer: ``(trained, decoded keys, decoded values)``, ``trained`` holding per layer [key map, key
    codebooks, value map, value codebooks]. Without ``trained``, each map (the least-squares affine
    map from ``_sources``, rounded to fp16) and each residual's k3v3 codebooks are fitted on these
    vectors as they are reached, so training sees what a decoder sees."""
    fit = trained is None
    trained = trained or [[None] * 4 for _ in range(keys.shape[0])]
    k_hat, v_hat = np.zeros_like(keys), np.zeros_like(values)
    for layer, parts in enumerate(trained):
        for i, (kind, x, hat, seed) in enumerate((("k", keys, k_hat, 1234), ("v", values, v_hat, 4321))):
            sources = _sources(kind, layer, k_hat, v_hat, values_from_keys)
            if fit:
                parts[2 * i] = _fit(sources, x[layer])
            guess = _predict(parts[2 * i], *sources)
            if fit:
                parts[2 * i + 1] = _one_layer(kind, x[layer] - guess, PREDICTED_STAGES, seed + layer)
            hat[layer] = guess + _quantized(parts[2 * i + 1], kind, x[layer] - guess)
    return trained, k_hat, v_hat


def _xent_bits(train_ctx, train_sym, test_ctx, test_sym, contexts: int, size: int = 256) -> float:
    """Bits per symbol of ``test_sym`` under counts of (context, symbol) from the training codes,
    smoothed toward their order-0 frequencies (weight size/2)."""
    p0 = np.bincount(train_sym, minlength=size) + 1.0
    p0 /= p0.sum()
    counts = np.zeros((contexts, size))
    np.add.at(counts, (train_ctx, train_sym), 1)
    lam = size / 2
    p = (counts[test_ctx, test_sym] + lam * p0[test_sym]) / (counts.sum(1)[test_ctx] + lam)
    return float(-np.log2(p).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-results", action="store_true", help="print the tables without writing them to RESULTS.md")
    args = parser.parse_args()
    t_all = time.perf_counter()
    lm, L, H, D = load_model()
    model = lm.model
    fp16 = L * 2 * H * D * 2
    ids = np.asarray(T.encode(lm.tokenizer, real_text(600_000)), dtype=np.int64)
    calib_ids = ids[: 8 * CTX]
    ck, cv = _calibration(model, calib_ids)
    t = time.perf_counter()
    deep = Q.train({"k": ck, "v": cv}, "k16v4", pre_rope=True)
    t_train = time.perf_counter() - t
    print(f"trained k16v4 in {t_train:.0f} s", flush=True)

    contexts = []  # dicts: prefix, cont, k, v (exact pre-RoPE), lp, am (exact), codes (k16v4)
    for s, n in _held_out(ids, len(calib_ids)) + [(s, -LONG) for s in VALIDATION]:  # n < 0: validation
        prefix, cont = ids[s : s + abs(n)], ids[s + abs(n) : s + abs(n) + CONT + 1]
        k, v, lp, am = _exact_pass(model, prefix, cont)
        contexts.append({"start": s, "n": n, "prefix": prefix, "cont": cont, "k": k, "v": v, "lp": lp, "am": am,
                         "codes": Q.encode(deep, k, v)})
        print(f"context {s} of {n} captured ({time.perf_counter() - t_all:.0f} s)", flush=True)

    def decoded(ctx, preset, sharpen=1.0):
        cb = KS.truncate(deep, preset).sharpened(sharpen)
        kc, vc = ctx["codes"]
        return Q.decode(cb, (kc[:, :, : cb.max_stages("k")], vc[:, :, : cb.max_stages("v")]))

    def _logp(cache, cont) -> np.ndarray:
        """Natural-log next-token distributions ``[len(cont), vocab]`` of ``cont`` after ``cache``."""
        return torch.log_softmax(C.next_token_logits(model, cache, cont), dim=-1).numpy()

    def ratio(n, arrays, kl=False):
        """Pooled perplexity ratio, per-context ratios and top-1 agreement over the contexts of length ``n``;
        ``arrays(ctx)`` gives the (keys, values) to restore. ``kl``: and the mean KL divergence of the
        next-token distributions from the exact cache's (nats per token)."""
        nll, nll_e, agree, per, kls = [], [], [], [], []
        for ctx in (c for c in contexts if c["n"] == n):
            k, v = arrays(ctx)
            logp = _logp(KS.restore_cache(model, ctx["prefix"], k, v, pre_rope=True), ctx["cont"])
            nll.append(-logp[np.arange(len(ctx["cont"]) - 1), ctx["cont"][1:]])
            nll_e.append(-ctx["lp"])
            agree.append(logp.argmax(-1) == ctx["am"])
            per.append(float(np.exp(nll[-1].mean() - nll_e[-1].mean())))
            if kl:
                if "exact logp" not in ctx:  # the exact cache's distributions, through the same restore path
                    ctx["exact logp"] = _logp(KS.restore_cache(model, ctx["prefix"], ctx["k"], ctx["v"], pre_rope=True), ctx["cont"])
                ref = ctx["exact logp"]
                kls.append(float((np.exp(ref) * (ref - logp)).sum(-1).mean()))
        r = float(np.exp(np.concatenate(nll).mean() - np.concatenate(nll_e).mean()))
        return (r, per, float(np.concatenate(agree).mean())) + ((float(np.mean(kls)),) if kl else ())

    def cell(r) -> str:
        return f"{r[0]:.4f} ({min(r[1]):.3f}–{max(r[1]):.3f}) | {r[2]:.3f}"

    def bytes_per_token(preset: str, layer0: bool = False) -> float:
        """Code bytes as stored per token of the 1,024-token contexts (identical for each), codebooks over 1e6 tokens."""
        if layer0:
            preset += "+k0@0+v0@0"
        cb = KS.truncate(deep, preset)
        ctx = contexts[0]
        kc, vc = ctx["codes"]
        code = KS.stored_code_bytes(cb, (kc[:, :, : cb.max_stages("k")], vc[:, :, : cb.max_stages("v")]), start=C.SINKS)
        return code / ctx["n"] + cb.nbytes / 1e6

    # -- 1. where the loss at 8,000 comes from -----------------------------------------------------
    base_long = {id(c): decoded(c, BASE) for c in contexts if c["n"] == LONG}

    def keys_exact(units):
        def arrays(ctx):
            kq, vq = base_long[id(ctx)]
            k = kq.copy()
            for layer, head in units:
                k[layer, head] = ctx["k"][layer, head]
            return k, vq
        return arrays

    scan = [(layer, ratio(LONG, keys_exact([(layer, slice(None))]))) for layer in range(L)]
    print("layer scan done", flush=True)
    worst = sorted(range(L), key=lambda layer: scan[layer][1][0])
    top, nxt = sorted(worst[:4]), sorted(worst[4:8])
    heads = [((layer, h), ratio(LONG, keys_exact([(layer, h)]))) for layer in top for h in range(H)]
    best_heads = [u for u, _ in sorted(heads, key=lambda x: x[1][0])[:4]]
    both_exact = ratio(LONG, keys_exact(best_heads))
    base_r = ratio(LONG, lambda ctx: base_long[id(ctx)])
    base_long.clear()  # the decoded caches: their memory for what follows
    print("head scan done", flush=True)

    # -- 2. presets from the scan; 4. layer 0 from the tokens --------------------------------------
    top_s, nxt_s = ",".join(map(str, top)), ",".join(map(str, nxt))
    first, rest = f"{best_heads[0][0]}", ",".join(str(layer) for layer, _ in best_heads[1:])
    first_h, rest_h = f"{best_heads[0][0]}.{best_heads[0][1]}", ",".join(f"{layer}.{h}" for layer, h in best_heads[1:])
    default = P.resolve("compact", lm.identity.weights_hash)
    by_head = [f"k3v3+k12@{first}+k8@{rest}+k2@0-5+v2@0-1", f"k3v3+k12@{first_h}+k8@{rest_h}+k2@0-5+v2@0-1",
               f"k3v3+k16@{first_h}+k12@{rest_h}+k2@0-5+v2@0-1", f"k3v3+k16@{first_h},{rest_h}+k2@0-5+v2@0-1"]
    presets = [BASE, f"k4v3+k8@{top_s}", f"k3v3+k8@{top_s}+k2@0-5", f"k3v3+k12@{top_s}+k2@0-5", f"k3v4+k8@{top_s}+k2@0-5+v2@0-5",
               f"k2v3+k8@{top_s}+k4@{nxt_s}", f"k2v2+k8@{top_s}+k4@{nxt_s}", *by_head]
    presets += [default] if default not in presets else []
    layer0_err = max(float(np.abs(np.stack(_layer0_from_tokens(model, c["prefix"])) - np.stack([c["k"][0], c["v"][0]])).max())
                     for c in contexts)

    def with_layer0(preset):
        def arrays(ctx):
            k, v = decoded(ctx, preset)
            k[0], v[0] = _layer0_from_tokens(model, ctx["prefix"])
            return k, v
        return arrays

    preset_rows = []
    for p in presets:
        arrays = lambda ctx, p=p: decoded(ctx, p)  # noqa: E731
        preset_rows.append((p, bytes_per_token(p), ratio(CTX, arrays), ratio(LONG, arrays)))
        print(f"preset {p} done", flush=True)
    for p in (BASE, default):
        preset_rows.append((f"{p}, layer 0 from the tokens", bytes_per_token(p, layer0=True), ratio(CTX, with_layer0(p)), ratio(LONG, with_layer0(p))))
    validation = [(p, ratio(-LONG, lambda ctx, p=p: decoded(ctx, p))) for p in dict.fromkeys((BASE, f"k3v3+k8@{top_s}+k2@0-5", by_head[0], default))]
    print("validation done", flush=True)

    # -- 8. how much the codebooks' training moves the figures ------------------------------------
    retrained = []
    ok, ov = _calibration(model, ids[8 * CTX : 16 * CTX])  # clear of every held-out context (they start 20,000 tokens past the calibration)
    other = {"k": ok, "v": ov}
    for label, data, seed in (("seed 1", {"k": ck, "v": cv}, 1), ("seed 2", {"k": ck, "v": cv}, 2), ("the next 8,192 tokens", other, 1234)):
        cb = Q.train(data, BASE, pre_rope=True, seed=seed)
        arrays = lambda ctx, cb=cb: Q.decode(cb, Q.encode(cb, ctx["k"], ctx["v"]))  # noqa: E731
        retrained.append((label, ratio(CTX, arrays), ratio(LONG, arrays), ratio(-LONG, arrays)))
    del other, ok, ov
    print("retraining done", flush=True)

    # -- 9. sharpened keys --------------------------------------------------------------------------
    factor = P.key_sharpening(lm.identity.weights_hash)
    default_cb = KS.truncate(deep, default)
    centre = np.stack([layer[0].mean(1) for layer in default_cb.books["k"]])[:, :, None, :]  # Codebooks.sharpened's centres

    def on_heads(keys, s, heads):
        """Keys with only ``heads`` (None: all) moved ``s`` times further from their centres."""
        far = centre + s * (keys - centre)
        if heads is None:
            return far
        out = keys.copy()
        for layer, h in heads:
            out[layer, h] = far[layer, h]
        return out

    def sharpened(s, heads=None):
        def arrays(ctx):
            k, v = decoded(ctx, default)
            return on_heads(k, s, heads), v
        return arrays

    def exact_sharpened(s, heads=None):
        return lambda ctx: (on_heads(ctx["k"], s, heads), ctx["v"])

    sharpen_rows = [(f"{default}, as trained", lambda ctx: decoded(ctx, default))]
    sharpen_rows += [(f"{default}, keys sharpened x{s}{' (the default restore)' if s == factor else ''}", lambda ctx, s=s: decoded(ctx, default, s))
                     for s in dict.fromkeys((1.05, factor, 1.1))]
    sharpen_rows += [(f"{default}, the keys of heads {', '.join(f'{a}.{b}' for a, b in best_heads)} sharpened x1.1", sharpened(1.1, best_heads)),
                     (f"exact keys and values, keys sharpened x{factor} (control)", exact_sharpened(factor)),
                     (f"exact keys and values, the keys of heads {', '.join(f'{a}.{b}' for a, b in best_heads)} sharpened x1.1 (control)", exact_sharpened(1.1, best_heads))]
    sharpen_rows = [(label, ratio(CTX, arrays, kl=True), ratio(LONG, arrays, kl=True), ratio(-LONG, arrays, kl=True)) for label, arrays in sharpen_rows]
    print("sharpening done", flush=True)

    # -- 3. bits by attention mass received --------------------------------------------------------
    def by_mass(ctx):
        mass = _attention_mass(model, ctx["prefix"])
        mass[: C.SINKS] = np.inf  # recomputed anyway
        upper = mass >= np.median(mass)
        (k6, v6), (k2, v2) = decoded(ctx, "k6v4"), decoded(ctx, "k2v2")
        return np.where(upper[None, None, :, None], k6, k2), np.where(upper[None, None, :, None], v6, v2)

    mass_r = ratio(CTX, by_mass)
    print("attention-mass allocation done", flush=True)

    # -- 5. a rotation before VQ -------------------------------------------------------------------
    rng = np.random.default_rng(0)
    dim = ck.shape[-1]
    rot = {kind: np.linalg.qr(rng.standard_normal((L, H, dim, dim)))[0].astype(np.float32) for kind in Q.KINDS}
    turned = Q.train({"k": ck @ rot["k"], "v": cv @ rot["v"]}, BASE, pre_rope=True)

    def rotated(ctx):
        kq, vq = Q.decode(turned, Q.encode(turned, ctx["k"] @ rot["k"], ctx["v"] @ rot["v"]))
        return kq @ rot["k"].transpose(0, 1, 3, 2), vq @ rot["v"].transpose(0, 1, 3, 2)

    rot_rows = (ratio(CTX, rotated), ratio(LONG, rotated))
    print("rotation done", flush=True)

    # -- 6. cross-layer prediction ------------------------------------------------------------------
    long = [c for c in contexts if c["n"] == LONG]
    explained = {}
    for kind, calib in (("k", ck), ("v", cv)):
        shares = []
        for layer in range(1, L):
            x = calib[layer - 1].transpose(1, 0, 2).reshape(calib.shape[2], -1)
            y = calib[layer].transpose(1, 0, 2).reshape(calib.shape[2], -1)
            x1 = np.hstack([x, np.ones((len(x), 1), np.float32)])
            w = np.linalg.lstsq(x1, y, rcond=None)[0]
            err = tot = 0.0
            for c in long:
                a = c[kind][layer - 1].transpose(1, 0, 2).reshape(c["n"], -1)
                b = c[kind][layer].transpose(1, 0, 2).reshape(c["n"], -1)
                err += float(((np.hstack([a, np.ones((len(a), 1), np.float32)]) @ w - b) ** 2).sum())
                tot += float(((b - b.mean(0)) ** 2).sum())
            shares.append(1 - err / tot)
        explained[kind] = shares

    plain = f"k{PREDICTED_STAGES}v{PREDICTED_STAGES}"
    plain_bpt = bytes_per_token(plain)
    t = time.perf_counter()
    decoded(long[0], plain)
    t_gather = time.perf_counter() - t
    plain_rows = (f"{plain}, every layer alone", plain_bpt, ratio(CTX, lambda ctx: decoded(ctx, plain), kl=True),
                  ratio(LONG, lambda ctx: decoded(ctx, plain), kl=True), ratio(-LONG, lambda ctx: decoded(ctx, plain), kl=True), t_gather)
    predicted_rows = [plain_rows]
    for label, from_keys in ((f"{plain}, each kind from the decoded previous layer", False),
                             (f"{plain}, keys from the decoded previous layer, values from it and this layer's decoded keys", True)):
        trained, _, _ = _predicted(ck, cv, from_keys)
        side = sum(w.size * 2 for wk, _, wv, _ in trained for w in (wk, wv) if w is not None)  # the maps, fp16
        side += sum(cb.nbytes for _, cbk, _, cbv in trained for cb in (cbk, cbv))
        bpt = plain_bpt - KS.truncate(deep, plain).nbytes / 1e6 + side / 1e6
        _, k_hat, v_hat = _predicted(long[0]["k"], long[0]["v"], from_keys, trained)
        t = time.perf_counter()  # the products a restore would add: one per layer and kind
        for layer, (wk, _, wv, _) in enumerate(trained):
            _predict(wk, *_sources("k", layer, k_hat, v_hat, from_keys))
            _predict(wv, *_sources("v", layer, k_hat, v_hat, from_keys))
        t_pred = time.perf_counter() - t
        arrays = lambda ctx, trained=trained, from_keys=from_keys: _predicted(ctx["k"], ctx["v"], from_keys, trained)[1:]  # noqa: E731
        predicted_rows.append((label, bpt, ratio(CTX, arrays, kl=True), ratio(LONG, arrays, kl=True), ratio(-LONG, arrays, kl=True), t_pred))
    del k_hat, v_hat
    print("cross-layer prediction done", flush=True)

    # -- 10. the sharpening factor by preset ---------------------------------------------------------
    factors = (1.0, 1.05, 1.1, 1.15)
    by_preset = [(p, [(ratio(CTX, lambda ctx, p=p, s=s: decoded(ctx, p, s), kl=True)[3],
                       ratio(LONG, lambda ctx, p=p, s=s: decoded(ctx, p, s), kl=True)[3]) for s in factors])
                 for p in dict.fromkeys(("k2v1", "k3v2", BASE, default, "k6v4", "k8v4"))]
    print("sharpening by preset done", flush=True)

    # -- 7. entropy coding of the code indices -------------------------------------------------------
    base_cb = KS.truncate(deep, BASE)
    calib_codes = Q.encode(base_cb, ck, cv)
    held = [Q.encode(base_cb, c["k"][:, :, C.SINKS :], c["v"][:, :, C.SINKS :]) for c in long]
    bits = {"order 0": [], "previous head, same stage": [], "previous stage, same head": [], "previous position": []}
    tables = {name: 0 for name in bits}

    def stream(ki: int, layer: int, h: int, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """One codebook's codes, int64: (the calibration's, the held-out contexts' joined)."""
        return (calib_codes[ki][layer, h, stage].astype(np.int64),
                np.concatenate([x[ki][layer, h, stage] for x in held]).astype(np.int64))

    for ki, kind in enumerate(Q.KINDS):
        for layer in range(L):
            for stage in range(len(base_cb.stages(kind)[layer])):
                for h in range(H):
                    tr, te = stream(ki, layer, h, stage)
                    none = (np.zeros_like(tr), np.zeros_like(te)), 1  # no context: the order-0 model
                    models = {"order 0": none,
                              "previous head, same stage": (stream(ki, layer, h - 1, stage), 256) if h else none,
                              "previous stage, same head": (stream(ki, layer, h, stage - 1), 256) if stage else none}
                    for name, ((ctx_tr, ctx_te), n_ctx) in models.items():
                        bits[name].append(_xent_bits(ctx_tr, tr, ctx_te, te, n_ctx))
                        tables[name] += n_ctx * 256 * 2
                    # previous position within each context (the calibration as one run)
                    bits["previous position"].append(float(np.mean([_xent_bits(tr[:-1], tr[1:], x[ki][layer, h, stage][:-1].astype(np.int64),
                                                                            x[ki][layer, h, stage][1:].astype(np.int64), 256) for x in held])))
                    tables["previous position"] += 256 * 256 * 2
    codes_per_token = len(bits["order 0"])
    base_bpt = bytes_per_token(BASE)

    # -- tables ---------------------------------------------------------------------------------------
    head = (f"Run at {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. `.venv/bin/python benchmarks/kv_ideas.py` — {describe(f'torch {torch.__version__}')}; SmolLM2-135M-Instruct; "
            f"pre-RoPE k16v4 trained in {t_train:.0f} s on the first 8,192 tokens of `corpus.real_text` (kv.py's calibration); "
            f"held-out contexts at kv.py's offsets: {[c['start'] for c in contexts if c['n'] == CTX]} (1,024 tokens) and "
            f"{[c['start'] for c in long]} (8,000), each followed by 128 teacher-forced tokens; window recomputed; ppl ratio "
            f"pooled over the contexts (min–max per context), top-1 = agreement of the argmax with the exact cache's. "
            f"B/token all-inclusive = code streams as stored + codebooks over 1e6 tokens; fp16 = {fp16:,} B/token. "
            f"Total {time.perf_counter() - t_all:.0f} s.")
    lines = ["", "## Tier K ideas on kv.py's held-out protocol (`benchmarks/kv_ideas.py`)", "", head, "",
             f"### Where the loss at {LONG:,} tokens comes from: {BASE} everywhere, the keys of one layer (head) exact", "",
             f"{BASE}, nothing exact: ppl ratio {cell(base_r)} (top-1).", "",
             "| keys exact | ppl ratio (min–max) | top-1 |", "|---|---:|---:|"]
    lines += [f"| layer {layer} | {cell(r)} |" for layer, r in sorted(scan, key=lambda x: x[1][0])[:10]]
    lines.append(f"| (the other {L - 10} layers) | {min(r[0] for _, r in scan if _ not in worst[:10]):.4f}–"
                 f"{max(r[0] for _, r in scan if _ not in worst[:10]):.4f} | |")
    lines += [f"| layer {layer}, head {h} | {cell(r)} |" for (layer, h), r in heads]
    lines += [f"| heads {', '.join(f'{a}.{b}' for a, b in best_heads)} together (fp16: +{4 * 128} B/token) | {cell(both_exact)} |", ""]
    lines += ["### Bits by importance per layer (from the scan above), and layer 0 from the tokens", "",
              f"Layer 0 computed from each token alone (embedding, `input_layernorm`, `k_proj`/`v_proj`): largest difference from the "
              f"captured keys and values {layer0_err:.2e}.", "",
              f"| preset | all-incl. B/token | ratio vs fp16 | ppl ratio at {CTX:,} (min–max) | top-1 | ppl ratio at {LONG:,} (min–max) | top-1 |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {p}{' (the default)' if p == default else ''} | {b:,.1f} | {fp16 / b:.1f}x | {cell(r1)} | {cell(r2)} |" for p, b, r1, r2 in preset_rows]
    lines += ["", f"Validation: {LONG:,}-token contexts at {list(VALIDATION)}, which chose nothing above:", "",
              f"| preset | ppl ratio at {LONG:,} (min–max) | top-1 |", "|---|---:|---:|"]
    lines += [f"| {p} | {cell(r)} |" for p, r in validation]
    lines += ["", f"### How much the codebooks' training moves the figures ({BASE}, calibration as above unless named)", "",
              f"| training | ppl ratio at {CTX:,} (min–max) | top-1 | ppl ratio at {LONG:,} (min–max) | top-1 | validation at {LONG:,} (min–max) | top-1 |",
              "|---|---:|---:|---:|---:|---:|---:|",
              f"| seed 1234 (every table above) | {cell(next(r for p, _, r, _ in preset_rows if p == BASE))} | {cell(base_r)} | "
              f"{cell(next(r for p, r in validation if p == BASE))} |"]
    lines += [f"| {label} | {cell(a)} | {cell(b)} | {cell(c)} |" for label, a, b, c in retrained]
    lines += ["", "### Sharpened keys: each head's de-quantized keys moved s times further from its centre (the mean of its first-stage centroids)", "",
              "KL = mean KL divergence of the 128 next-token distributions from the exact cache's, nats per token. The controls apply the "
              "same move to exact keys: what it does to the model itself.", "",
              f"| keys | ppl ratio at {CTX:,} (min–max) | top-1 | KL | ppl ratio at {LONG:,} (min–max) | top-1 | KL | validation at {LONG:,} (min–max) | top-1 | KL |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {label} | {cell(a)} | {a[3]:.4f} | {cell(b)} | {b[3]:.4f} | {cell(c)} | {c[3]:.4f} |" for label, a, b, c in sharpen_rows]
    lines += ["", "### Bits by attention mass received, a rotation before VQ", "",
              f"| configuration | ppl ratio at {CTX:,} (min–max) | top-1 | ppl ratio at {LONG:,} (min–max) | top-1 |", "|---|---:|---:|---:|---:|",
              f"| {BASE} (every position alike) | {cell(next(r for p, _, r, _ in preset_rows if p == BASE))} | {cell(base_r)} |",
              f"| k6v4 on the half of positions that receive the most attention, k2v2 on the rest (mean {BASE}) | {cell(mass_r)} | — | — |",
              f"| {BASE} after a random orthogonal rotation per (layer, head, kind) | {cell(rot_rows[0])} | {cell(rot_rows[1])} |", "",
              "### Cross-layer prediction", "",
              f"Share of the variance of layer l's keys (values), all heads, that a linear map from layer l-1's exact ones predicts "
              f"(fitted on the calibration, measured on the {LONG:,}-token contexts): keys mean {np.mean(explained['k']):.3f} "
              f"(min {np.min(explained['k']):.3f}, max {np.max(explained['k']):.3f}), values mean {np.mean(explained['v']):.3f} "
              f"(min {np.min(explained['v']):.3f}, max {np.max(explained['v']):.3f}).", "",
              f"Closed loop on the protocol: each layer from layer 1 on coded as the residual of an fp16 affine map of decoded vectors "
              f"(every head's side by side), the residuals in their own {plain} codebooks; B/token counts the maps and those codebooks. "
              f"s at {LONG:,}: for one {LONG:,}-token context, the plain row's decode (every layer's gather and sum of centroids), and "
              f"for the others the maps' matrix products alone, every layer one after another (numpy float32), which a restore would add "
              f"to such a decode: measured side by side in this run. KL as in the sharpened-keys table.", "",
              f"| configuration | B/token | ratio vs fp16 | ppl ratio at {CTX:,} (min–max) | top-1 | KL | ppl ratio at {LONG:,} (min–max) | top-1 | KL | "
              f"validation at {LONG:,} (min–max) | top-1 | KL | s at {LONG:,} |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {label} | {b:,.1f} | {fp16 / b:.1f}x | {cell(x)} | {x[3]:.4f} | {cell(y)} | {y[3]:.4f} | {cell(z)} | {z[3]:.4f} | {t:.3f} |"
              for label, b, x, y, z, t in predicted_rows]
    lines += ["", "### The sharpening factor by preset: KL divergence from the exact cache's next-token distributions (nats per token)", "",
              "| preset | " + " | ".join(f"x{s} at {CTX:,}" for s in factors) + " | " + " | ".join(f"x{s} at {LONG:,}" for s in factors) + " |",
              "|---|" + "---:|" * (2 * len(factors))]
    for p, kls in by_preset:
        cols = []
        for i in (0, 1):
            best = min(k[i] for k in kls)
            cols += [f"**{k[i]:.4f}**" if k[i] == best else f"{k[i]:.4f}" for k in kls]
        lines.append(f"| {p}{' (the default)' if p == default else ''} | " + " | ".join(cols) + " |")
    lines += ["",
              f"### Entropy coding of the {BASE} code indices ({codes_per_token} codes a token, stored at 8 bits each: {base_bpt:,.1f} B/token all-inclusive)", "",
              "| context model | bits / code (held-out) | tables MB | B/token all-inclusive | ratio vs fp16 |", "|---|---:|---:|---:|---:|"]
    for name, b in bits.items():
        bpt = base_bpt - codes_per_token + np.mean(b) * codes_per_token / 8 + tables[name] / 1e6  # 8 bits a code now
        lines.append(f"| {name} | {np.mean(b):.3f} | {tables[name] / 1e6:.2f} | {bpt:,.1f} | {fp16 / bpt:.1f}x |")
    publish(lines, append=not args.no_results)


if __name__ == "__main__":
    main()
