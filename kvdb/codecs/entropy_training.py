"""Training entropy-coded codebooks (kvdb.codecs.entropy_coded): the rotation of Fisher-scaled
calibration vectors, per head or per layer; the one step that spends a preset's bits; the
cross-layer predictor; and the classes' rANS tables and reconstructions. Kept apart from the coder
because a restore or an ingest never trains: only ``kvdb codebooks train`` and the shipped
codebooks' first build do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from kvdb.codecs import rans, transform
from kvdb.codecs.entropy_coded import CLASSES, JOINT, KINDS, ROUNDING, EntropyCodebooks, closed_loop, predicted_rows
from kvdb.errors import InvalidArgument


def _symbol_counts(q: np.ndarray) -> np.ndarray:
    """Counts ``[rows, 256]`` of each row's rANS symbols (value + 127, 255 for escapes)."""
    rows = len(q)
    return np.bincount((rans.symbols(q) + 256 * np.arange(rows)[:, None]).reshape(-1), minlength=rows * 256).reshape(
        rows, 256
    )


def _bits(counts: np.ndarray) -> np.ndarray:
    """Each row's empirical entropy in bits per value (an escape also pays its 16 bits)."""
    total = counts.sum(1, keepdims=True)
    p = counts / np.maximum(total, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(counts > 0, p * np.log2(p), 0.0).sum(1)
    return h + 16 * p[:, rans.ESCAPE]


def _step_for(integers_of: Callable[[float], np.ndarray], scale: float, bits: float) -> float:
    """The step whose integers (``integers_of(step)``, ``[rows, n]``) have ``bits`` bits of entropy
    per value on average, by bisection on its logarithm (entropy falls as the step grows);
    ``scale`` bounds the coefficients."""
    lo, hi = np.log(scale * 1e-6 + 1e-30), np.log(scale * 2 + 1e-30)
    for _ in range(30):
        mid = (lo + hi) / 2
        rate = float(_bits(_symbol_counts(integers_of(float(np.exp(mid))))).mean())
        lo, hi = (mid, hi) if rate > bits else (lo, mid)
    return float(np.exp(hi))


def _predictor(y: np.ndarray, rows: np.ndarray, inputs: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Per layer, the least-squares matrix ``[P, Q]`` predicting its ``rows`` of calibration
    coefficients ``y`` ``[layers, rows, n]`` from the previous layer's ``inputs`` rows
    (ridge-regularised, as a fraction of the inputs' mean variance); layer 0's is zero."""
    out = np.zeros((len(y), len(rows), len(inputs)), np.float32)
    for layer in range(1, len(y)):
        x, target = y[layer - 1, inputs].astype(np.float64), y[layer, rows].astype(np.float64)
        gram = x @ x.T / x.shape[1]
        gram += ridge * np.trace(gram) / len(gram) * np.eye(len(gram))
        out[layer] = np.linalg.solve(gram, x @ target.T / x.shape[1]).T
    return out.astype(np.float16).astype(np.float32)  # stored as float16 (half the bytes), so coded with those values


def train(
    vectors: dict[str, np.ndarray],
    fisher: dict[str, np.ndarray],
    preset: str,
    pre_rope: bool = True,
    rounding: float = ROUNDING,
    meta: dict | None = None,
) -> EntropyCodebooks:
    """Entropy-coded codebooks from calibration ``vectors`` (kind -> ``[layers, heads, n, dim]``) and
    the diagonal Fisher information of the model's loss with respect to them (kind -> ``[layers, heads, dim]``):
    the step that spends the preset's bits per element on the calibration, and the classes' tables.

    The predictor is fitted to the exact previous layer, not to the previous layer as decoded:
    fitted again to the decoded one, SmolLM2's ``e1.25p64`` spent 9% fewer bits held out at 5%
    less squared error, but lost more to the model (decision 0042)."""
    bits, predicted, inputs = (
        transform.preset_bits(preset),
        transform.predicted_coefficients(preset),
        transform.prediction_inputs(preset),
    )
    joint = transform.is_joint(preset)
    layers, heads, n, dim = vectors["k"].shape
    if n < 2:
        raise InvalidArgument(f"training entropy-coded codebooks needs at least 2 calibration positions, got {n}")
    limit, unit = (2 * heads * dim, "layer") if joint else (dim, "head")
    if predicted > limit:
        raise InvalidArgument(
            f"preset {preset!r} predicts {predicted} coefficients per {unit}, but {unit}s have {limit}"
        )
    if joint:
        centre, weights, basis, y = _joint_pca(vectors, fisher)
    else:
        centre, weights, basis, coefficients = {}, {}, {}, {}
        for kind in KINDS:
            centre[kind], weights[kind], basis[kind], coefficients[kind] = transform.fisher_pca(
                vectors[kind], fisher[kind]
            )
        # per layer, rows in stream order
        y = np.stack([coefficients[kind] for kind in KINDS], axis=1).reshape(layers, 2 * heads * dim, n)
    rows, input_rows = predicted_rows(heads, dim, predicted, joint), predicted_rows(heads, dim, inputs, joint)
    fed = np.searchsorted(rows, input_rows)
    predictor = _predictor(y, rows, input_rows) if predicted else np.zeros((0, 0, 0), np.float32)

    def by_kind(a: np.ndarray) -> np.ndarray:
        """Rows kind > layer > head > coefficient: the order the tables were first trained in,
        kept so that a preset without prediction trains as it did (a joint one: layer > coefficient)."""
        if joint:
            return a.reshape(-1, a.shape[-1])
        return a.reshape(layers, 2, -1, a.shape[-1]).transpose(1, 0, 2, 3).reshape(-1, a.shape[-1])

    def integers(y: np.ndarray, step: float, value_of=None) -> np.ndarray:
        """Closed-loop integers of ``y`` (``value_of``: the decoder's value of integers, by default
        ``q * step``), which is left holding what they code."""
        return by_kind(
            closed_loop(y, predictor, rows, step, rounding, value_of or (lambda _layer, q: q * np.float32(step)), fed)
        )

    sample = y[:, :, :: max(1, n // 2048)]  # a sample of positions sets the step; all of them the tables
    step = _step_for(lambda step: integers(sample.copy(), step), float(np.abs(sample).max()), bits)

    residual = y.copy()
    q = integers(residual, step)
    entropy = _bits(_symbol_counts(q))
    edges = np.unique(np.quantile(entropy, np.linspace(0, 1, CLASSES + 1)[1:-1]))
    row_class = np.searchsorted(edges, entropy, side="right").astype(np.int32)  # < CLASSES
    freqs, recon, calibration = _tables(q, by_kind(residual), row_class, step)
    if joint:
        classes = {JOINT: row_class.reshape(layers, 2 * heads * dim)}
    else:
        classes = {kind: row_class.reshape(2, layers, heads, dim)[i] for i, kind in enumerate(KINDS)}
    books = EntropyCodebooks(
        layers,
        heads,
        dim,
        pre_rope,
        preset,
        centre,
        weights,
        basis,
        step,
        rounding,
        classes,
        freqs,
        recon,
        {},
        predicted,
        predictor,
        inputs if inputs != predicted else 0,
        joint,
    )
    if predicted:  # the tables once more, predicting from values decoded as the first tables decode them
        residual = y.copy()
        q = integers(residual, step, books.value_of_rows)
        freqs, recon, calibration = _tables(q, by_kind(residual), row_class, step)
        books = replace(books, freqs=freqs, recon=recon)
    books.meta = dict(meta or {}, calibration_bits=round(calibration, 4))
    return books


def _joint_pca(vectors: dict[str, np.ndarray], fisher: dict[str, np.ndarray]) -> tuple[dict, dict, dict, np.ndarray]:
    """``fisher_pca`` of each layer's keys and values, all heads, as one vector (kind > head >
    dim): per kind ``centre`` and ``weights`` ``[layers, heads, dim]``, the basis ``{JOINT:
    [layers, R, R]}`` (float16 values, columns by falling variance) and the calibration
    coefficients ``[layers, R, n]``. SmolLM2's heads share much of what they hold: at one step,
    the joint rotation codes held-out vectors in 25% fewer bits than one per head, at less error (decision 0043)."""
    weights = {kind: transform.fisher_weights(fisher[kind]) for kind in KINDS}
    # [layers, 2, heads, n, dim]
    x = np.stack([np.asarray(vectors[kind], np.float32) * weights[kind][:, :, None] for kind in KINDS], axis=1)
    layers, _, heads, n, dim = x.shape
    mu = x.mean(3)
    flat = (x - mu[:, :, :, None]).transpose(0, 3, 1, 2, 4).reshape(layers, n, 2 * heads * dim)
    # a layer at a time in float64
    gram = np.stack([wide.T @ wide for wide in (flat[layer].astype(np.float64) for layer in range(layers))])
    _, vecs = np.linalg.eigh(gram / n)
    # stored as float16 (half the bytes), so coded with those values
    basis = np.ascontiguousarray(vecs[..., ::-1]).astype(np.float16).astype(np.float32)
    centre = {kind: mu[:, i] / weights[kind] for i, kind in enumerate(KINDS)}
    return centre, weights, {JOINT: basis}, np.ascontiguousarray(np.matmul(flat, basis).swapaxes(1, 2))


def _tables(
    q: np.ndarray, coded: np.ndarray, row_class: np.ndarray, step: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """Each class's rANS frequencies and reconstruction (the mean of the ``coded`` values each of
    its symbols stood for), and the bits per value the integers ``q`` (``[rows, n]``) cost under them."""
    class_counts = np.zeros((CLASSES, 256), np.int64)
    np.add.at(class_counts, row_class, _symbol_counts(q))
    symbols = rans.symbols(q) + 256 * row_class[:, None]
    sums = np.bincount(
        symbols.reshape(-1), weights=coded.reshape(-1).astype(np.float64), minlength=CLASSES * 256
    ).reshape(CLASSES, 256)
    nominal = (np.arange(256) - rans.OFFSET) * step
    recon = np.where(class_counts > 0, sums / np.maximum(class_counts, 1), nominal).astype(np.float32)
    freqs = rans.frequencies(class_counts)
    calibration = float(
        (
            (class_counts * (rans.PRECISION - np.log2(np.maximum(freqs, 1)))).sum()
            + 16 * class_counts[:, rans.ESCAPE].sum()
        )
        / q.size
    )
    return freqs, recon, calibration
