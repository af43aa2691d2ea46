"""Entropy-coded scalar quantization of KV caches: the transform coder's rotation, one uniform
step for every coefficient, and the integers entropy coded (docs/decisions/0041-entropy-coded-tier-k.md;
bytes: docs/formats.md, "Entropy-coded tier K").

Why not the fixed-rate quantizers of ``t<bits>`` presets: with Fisher-scaled coefficients, squared
error is the loss, and for squared error a uniform quantizer followed by an entropy coder is within
a quarter bit of the rate-distortion bound at every rate, where a fixed-rate Lloyd-Max quantizer
gives up about half a bit on Gaussian coefficients and more on heavy tails, and can spend only
whole bits on a coefficient. One step for all coefficients is the Lagrangian's optimum: each
coefficient's distortion is about step**2 / 12 wherever it is coded at all, and a coefficient far
below the step costs almost no bits. Measured on SmolLM2 at 1,024 tokens (decision 0041): 3 bits
per element give a KL of 0.001 nats per token, against 0.020 for ``t3``.

Per (kind, layer, KV head) vectors are scaled by the square root of their diagonal Fisher
information and rotated onto their principal axes (:func:`kvdb.codecs.transform.fisher_pca`);
coefficient ``y`` becomes ``q = sign(y) * floor(|y| / step + rounding)``. Every coefficient
belongs to one of ``CLASSES`` classes (by its calibration entropy), whose frequency table codes
its integers (:mod:`kvdb.codecs.rans`) and whose reconstruction table gives each integer's value:
the calibration mean of the coefficients it stood for.

A ``p<count>`` preset (``e2p32``) also predicts each head's first ``count`` coefficients from
the previous layer's, decoded (closed loop: the encoder predicts from what the decoder will
have), by one least-squares matrix per layer over every head and kind, and codes what is left.
Measured on SmolLM2 (decision 0042): with all 64, 16% fewer bits at ``e2``'s step and 4.4 M
multiply-adds per token at restore; what the model sees gains more, as what rounds to 0 now
costs the residual's variance, not the coefficient's (``e2`` 7.4x at a KL of 0.030 nats per
token, ``e1.4p64`` 10.4x at 0.021). ``i<inputs>`` (``e1.35p64i32``) predicts from only each
head's first ``inputs`` coefficients of the previous layer: SmolLM2's 32 give the same bits as all
64 (1.765 against 1.767 per element held out, decision 0043) at half the multiply-adds, which are
most of a restore's work.

A ``j`` preset (``e0.9jp384``) rotates each layer's keys and values, all heads, as one vector:
a model's heads hold much of the same thing, and SmolLM2's joint coefficients cost 25% fewer bits
than per-head ones at one step, at less error (33% with prediction; decision 0043), for a
rotation of R x R multiply-adds per position and layer (R = 2 * heads * dim) where per head it
was 2 * heads * dim**2. Its ``p`` and ``i`` count the layer's coefficients, not a head's.

A node's codes are one payload: one rANS stream per layer, so a restore decodes a layer while the
previous one is placed in the cache. Within a layer's stream the rows are kind (keys, values) >
head > coefficient, each row the node's positions in order. A payload cannot be cut at a position
as token-major streams can: splitting a node decodes its integers and codes both halves again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdb.codecs import framing, rans, transform
from kvdb.errors import CorruptData

KINDS = ("k", "v")
MAGIC = b"KVDBEC\x00\x00"
# 2 adds the predictor, 3 its inputs, 4 the joint rotation; each set is written at the lowest version that holds it,
# byte for byte
VERSION = 4
JOINT = "joint"  # the key of a joint set's basis and classes
CLASSES = 64
ROUNDING = 0.5
PAYLOAD = 0  # the stream key of a node's payload among tier K's streams (no symbol alphabet is 0)


@dataclass
class EntropyCodebooks:
    """Per kind: ``centre``, ``weights`` ``[layers, heads, dim]``, ``basis`` ``[layers, heads, dim, dim]``
    (as :class:`kvdb.codecs.transform.TransformCodebooks`), ``classes`` int32 ``[layers, heads, dim]``;
    ``freqs`` uint16 and ``recon`` float32 ``[CLASSES, 256]`` (rANS symbols: value + 127, 255 escape);
    ``predictor`` float32 ``[layers, P, Q]`` (float16 values): the P predicted rows of a layer are
    ``predictor[layer] @`` the previous layer's Q input rows, decoded (layer 0's unused, zero).

    Per head, a layer's R = 2 * heads * dim rows are kind > head > coefficient; each head's first
    ``predicted`` are predicted, from each head's first ``inputs`` (0: as many as are predicted).
    A ``joint`` set rotates a layer's keys and values, all heads, as one vector of R: ``basis``
    and ``classes`` hold one entry, ``JOINT``, ``[layers, R, R]`` (float16 values, columns by
    falling variance) and ``[layers, R]``; a layer's rows are its R coefficients, its first
    ``predicted`` predicted from its predecessor's first ``inputs``."""

    layers: int
    heads: int
    dim: int
    pre_rope: bool
    preset: str
    centre: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    basis: dict[str, np.ndarray]
    step: float
    rounding: float
    classes: dict[str, np.ndarray]
    freqs: np.ndarray
    recon: np.ndarray
    meta: dict = field(default_factory=dict)
    predicted: int = 0
    predictor: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.float32))
    inputs: int = 0
    joint: bool = False
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- derived tables ----------------------------------------------------------------------

    def tables(self) -> rans.Tables:
        if "tables" not in self._derived:
            self._derived["tables"] = rans.Tables(self.freqs)
        return self._derived["tables"]

    @property
    def rows(self) -> int:
        """A layer's rows: its coefficients, keys' and values', all heads."""
        return 2 * self.heads * self.dim

    def row_classes(self, layer: int) -> np.ndarray:
        """The classes of a layer's rows in stream order, int32."""
        key = ("rows", layer)
        if key not in self._derived:
            kinds = (JOINT,) if self.joint else KINDS
            self._derived[key] = np.ascontiguousarray(
                np.concatenate([self.classes[kind][layer].reshape(-1) for kind in kinds]), dtype=np.int32
            )
        return self._derived[key]

    def predicted_rows(self) -> np.ndarray:
        """The rows of a layer (in stream order) that are predicted."""
        return predicted_rows(self.heads, self.dim, self.predicted, self.joint)

    @property
    def prediction_inputs(self) -> int:
        """The leading coefficients of the previous layer (per head, or of the layer if joint) that the prediction
        reads."""
        return self.inputs or self.predicted

    def input_rows(self) -> np.ndarray:
        """The rows of a layer (in stream order) its successor's prediction reads."""
        return predicted_rows(self.heads, self.dim, self.prediction_inputs, self.joint)

    def _fed(self) -> np.ndarray:
        """Which of the predicted rows are the input rows (``closed_loop``'s ``fed``)."""
        return np.searchsorted(self.predicted_rows(), self.input_rows())

    def encoder(self, kind: str) -> np.ndarray:
        key = ("encoder", kind)
        if key not in self._derived:
            self._derived[key] = transform.encoder_matrix(self.weights[kind], self.basis[kind])
        return self._derived[key]

    def decoder(self, kind: str) -> np.ndarray:
        key = ("decoder", kind)
        if key not in self._derived:
            self._derived[key] = transform.decoder_matrix(self.weights[kind], self.basis[kind])
        return self._derived[key]

    def joint_encoder(self) -> np.ndarray:
        """A joint set's ``[layers, R, R]`` of centred vectors (kind > head > dim) to coefficients:
        ``diag(w) @ basis``."""
        if "joint encoder" not in self._derived:
            self._derived["joint encoder"] = np.ascontiguousarray(
                self._joint_weights()[:, :, None] * self.basis[JOINT], dtype=np.float32
            )
        return self._derived["joint encoder"]

    def joint_decoder(self) -> np.ndarray:
        """A joint set's ``[layers, R, R]`` of coefficients to centred vectors: the encoder's inverse
        (the float16 basis is orthonormal only to about 1e-3), ``basis^-1 @ diag(1 / w)``."""
        if "joint decoder" not in self._derived:
            inverse = np.linalg.inv(self.basis[JOINT].astype(np.float64))
            self._derived["joint decoder"] = np.ascontiguousarray(
                inverse / self._joint_weights()[:, None, :], dtype=np.float32
            )
        return self._derived["joint decoder"]

    def _joint_weights(self) -> np.ndarray:
        return np.concatenate([self.weights[kind].reshape(self.layers, -1) for kind in KINDS], axis=1)

    def _joint_centre(self) -> np.ndarray:
        return np.concatenate([self.centre[kind].reshape(self.layers, -1) for kind in KINDS], axis=1)

    def sharpened(self, factor: float) -> EntropyCodebooks:
        """Not sharpened, as transform-coded keys are not (``TransformCodebooks.sharpened``)."""
        return self

    @property
    def nbytes(self) -> int:
        per_kind = sum(self.centre[k].size * 4 + self.weights[k].size * 4 for k in KINDS)
        if self.joint:
            rotation = self.basis[JOINT].size * 2 + self.classes[JOINT].size
        else:
            rotation = sum(self.basis[k].size * 4 + self.classes[k].size for k in KINDS)
        return per_kind + rotation + self.freqs.size * 6 + self.predictor.size * 2

    def bits_per_element(self) -> float:
        """Bits per element on the calibration vectors, as trained."""
        return float(self.meta.get("calibration_bits", float("nan")))

    # -- codes -------------------------------------------------------------------------------

    def encode(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Integers int16 ``[layers, heads, dim, seq]`` per kind of float ``[layers, heads, seq, dim]`` arrays
        (of a joint set: a layer's rows in stream order, split in two halves alike)."""
        y = self.coefficients(keys, values)
        q = closed_loop(
            y, self.predictor, self.predicted_rows(), self.step, self.rounding, self.value_of_rows, self._fed()
        ).reshape(self.layers, 2, self.heads, self.dim, -1)
        return q[:, 0], q[:, 1]

    def coefficients(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The rotated coefficients ``[layers, R, seq]`` (rows in stream order) of float
        ``[layers, heads, seq, dim]`` keys and values.

        Made a layer and head at a time as ``encoder^T @ (x - centre)^T`` straight into rows:
        stacking the cache and transposing it to rows took most of an encode's time."""
        x = [np.asarray(a, np.float32) for a in (keys, values)]
        y = np.empty((self.layers, self.rows, x[0].shape[2]), np.float32)
        blocks = [(i, kind, head) for i, kind in enumerate(KINDS) for head in range(self.heads)]  # stream order
        for layer in range(self.layers):
            if self.joint:  # each head's dims are a block of the encoder's rows; the products add up
                encoder = self.joint_encoder()[layer].reshape(len(blocks), self.dim, self.rows)
                y[layer] = 0
                for b, (i, kind, head) in enumerate(blocks):
                    y[layer] += encoder[b].T @ (x[i][layer, head] - self.centre[kind][layer, head]).T
            else:
                for b, (i, kind, head) in enumerate(blocks):
                    y[layer, b * self.dim : (b + 1) * self.dim] = (
                        self.encoder(kind)[layer, head].T @ (x[i][layer, head] - self.centre[kind][layer, head]).T
                    )
        return y

    def decode(self, codes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Float32 ``[layers, heads, seq, dim]`` keys and values of ``encode``'s integers."""
        classes = np.stack([self.row_classes(layer) for layer in range(self.layers)])
        y = self.values_of(classes[..., None], np.stack(codes, axis=1).reshape(self.layers, self.rows, -1))
        if self.predicted:
            rows, inputs = self.predicted_rows(), self.input_rows()
            for layer in range(1, self.layers):
                y[layer, rows] += self.predictor[layer] @ y[layer - 1, inputs]
        if self.joint:
            x = (np.matmul(y.swapaxes(1, 2), self.joint_decoder()) + self._joint_centre()[:, None]).reshape(
                self.layers, -1, 2, self.heads, self.dim
            )
            return x[:, :, 0].transpose(0, 2, 1, 3), x[:, :, 1].transpose(0, 2, 1, 3)
        y = y.reshape(self.layers, 2, self.heads, self.dim, -1)
        return tuple(
            np.matmul(y[:, i].swapaxes(2, 3), self.decoder(kind)) + self.centre[kind][:, :, None]
            for i, kind in enumerate(KINDS)
        )

    def value_of_rows(self, layer: int, q: np.ndarray) -> np.ndarray:
        """The values of a layer's predicted rows' integers ``q`` ``[P, n]`` (``closed_loop``'s ``value_of``)."""
        return self.values_of(self.row_classes(layer)[self.predicted_rows(), None], q)

    def values_of(self, classes: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Coefficients of integers ``q`` of coefficients of ``classes`` (broadcast against ``q``):
        the class's reconstruction of a symbol its table codes, else (an escaped value: past the
        tables' range, or of frequency 0 there) ``q * step``, as the rANS kernel decodes them."""
        symbol = rans.symbols(q)
        values = self.value_table()[classes, symbol]
        escaped = symbol == rans.ESCAPE
        if escaped.any():
            values = np.where(escaped, np.asarray(q, np.int64) * self.step, values).astype(np.float32)
        return values

    def value_table(self) -> np.ndarray:
        """``values_of`` as a table ``[CLASSES, 256]`` float32 of symbols (the escape's column unused):
        one gather per integer, where a test per integer of its frequency took most of an encode."""
        if "values" not in self._derived:
            nominal = (np.arange(256, dtype=np.int64) - rans.OFFSET) * self.step
            self._derived["values"] = np.where(self.freqs > 0, self.recon, nominal).astype(np.float32)
        return self._derived["values"]

    # -- stored layout -----------------------------------------------------------------------

    def code_streams(self, codes: tuple[np.ndarray, np.ndarray], start: int = 0) -> dict[int, np.ndarray]:
        """The node's payload (positions from ``start`` on) as tier K's one stream, ``{PAYLOAD: bytes}``."""
        tables = self.tables()
        streams = []
        for layer in range(self.layers):
            rows = np.concatenate([c[layer, :, :, start:].reshape(self.heads * self.dim, -1) for c in codes])
            streams.append(rans.encode(np.ascontiguousarray(rows, np.int16), self.row_classes(layer), tables))
        sizes = np.array([len(streams), *map(len, streams)], "<u4")
        return {PAYLOAD: np.frombuffer(b"".join([sizes.tobytes(), *streams]), np.uint8)}

    def stream_columns(self) -> dict[int, int]:
        """No columns: a payload's length depends on what it codes (integrity decodes it instead)."""
        return {}

    def _layer_streams(self, streams: dict[int, np.ndarray]) -> list[np.ndarray]:
        """Each layer's stream, a view into the payload (no copy)."""
        if set(streams) != {PAYLOAD}:
            raise CorruptData(f"entropy-coded tier K holds one payload stream, found streams {sorted(streams)}")
        data = np.ascontiguousarray(streams[PAYLOAD], np.uint8)
        if len(data) < 4 or int(data[:4].view("<u4")[0]) != self.layers:
            raise CorruptData(f"entropy-coded tier K payload does not hold {self.layers} layers")
        at = 4 * (self.layers + 1)
        if len(data) < at:
            raise CorruptData(f"entropy-coded tier K payload is {len(data)} bytes, shorter than its header")
        ends = at + np.cumsum(data[4:at].view("<u4"), dtype=np.int64)
        if ends[-1] != len(data):
            raise CorruptData(f"entropy-coded tier K payload is {len(data)} bytes, its header says {int(ends[-1])}")
        return [data[a:b] for a, b in zip([at, *ends[:-1]], ends)]

    def codes_from_streams(self, streams: dict[int, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
        tables = self.tables()
        codes = np.empty((2, self.layers, self.heads, self.dim, n), np.int16)
        for layer, data in enumerate(self._layer_streams(streams)):
            codes[:, layer] = rans.decode(data, self.row_classes(layer), n, tables).reshape(2, self.heads, self.dim, n)
        return codes[0], codes[1]

    def decode_streams(
        self, streams: dict[int, np.ndarray], n: int, used: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Each layer's ``(keys, values)``, float32 ``[heads, used, dim]``: the layer's stream decoded
        straight to coefficients (one kernel call, which lets go of the GIL: the next layer's runs on
        a second thread while this one is rotated back and placed), the predicted rows given their
        prediction from the previous layer's (a ``p<count>`` preset; the layers chain, so this stays
        on this thread), then one batched product per kind with the centre added in it
        (``baddbmm``: half the time of a product and an addition)."""
        import torch

        used = n if used is None else used
        tables, layer_streams = self.tables(), self._layer_streams(streams)
        blocks = 1 if self.joint else 2 * self.heads  # rows per block: the layer's, or a head's
        rotate = self._joint_rotation() if self.joint else self._head_rotation()

        def coefficients(layer: int) -> np.ndarray:
            y = np.empty((blocks, self.rows // blocks, used), np.float32)
            rans.decode_into(
                layer_streams[layer],
                self.row_classes(layer),
                n,
                tables,
                self.recon,
                self.step,
                y.reshape(self.rows, used),
            )
            return y

        predictor = torch.from_numpy(self.predictor)
        decoded = None  # the previous layer's input rows, decoded, [Q, used]
        with ThreadPoolExecutor(1) as ahead:
            pending = ahead.submit(coefficients, 0)
            for layer in range(self.layers):
                y = torch.from_numpy(pending.result())
                if layer + 1 < self.layers:
                    pending = ahead.submit(coefficients, layer + 1)
                if self.predicted:
                    lead = y[:, : self.predicted]  # the predicted rows: a view
                    if decoded is not None:
                        lead += (predictor[layer] @ decoded).view_as(lead)
                    decoded = lead[:, : self.prediction_inputs].reshape(-1, used)
                keys, values = rotate(layer, y)
                yield keys.numpy(), values.numpy()

    def _head_rotation(self) -> Callable[[int, Any], tuple[Any, Any]]:
        """A layer's keys and values ``[heads, used, dim]`` of its coefficients ``[2 * heads, dim, used]``:
        one batched product per kind with the centre added in it (``baddbmm``: half the time of a
        product and an addition)."""
        import torch

        decoders = {kind: torch.from_numpy(self.decoder(kind)) for kind in KINDS}
        centres = {kind: torch.from_numpy(self.centre[kind][:, :, None]) for kind in KINDS}

        def rotate(layer: int, y):
            y = y.view(2, self.heads, self.dim, -1)
            return tuple(
                torch.baddbmm(centres[kind][layer], y[i].transpose(1, 2), decoders[kind][layer])
                for i, kind in enumerate(KINDS)
            )

        return rotate

    def _joint_rotation(self) -> Callable[[int, Any], tuple[Any, Any]]:
        """As ``_head_rotation`` for a joint set's coefficients ``[1, R, used]``: one product of the
        layer's ``[used, R]`` by its decoder with the centre added in it, then each head's
        ``[used, dim]`` made contiguous (faster than a batched product per head that comes out
        contiguous, measured on SmolLM2)."""
        import torch

        decoder, centre = torch.from_numpy(self.joint_decoder()), torch.from_numpy(self._joint_centre())

        def rotate(layer: int, y):
            out = (
                torch.addmm(centre[layer], y[0].t(), decoder[layer])
                .view(-1, 2 * self.heads, self.dim)
                .transpose(0, 1)
                .contiguous()
            )
            return out[: self.heads], out[self.heads :]

        return rotate

    # -- bytes -------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """``MAGIC | u32 version | u32 header length | JSON header | payload | u32 CRC32`` (docs/formats.md)."""
        version = 4 if self.joint else 1 if not self.predicted else 2 if self.prediction_inputs == self.predicted else 3
        order = [
            "per kind (k, v): centre [L,H,D], "
            f"weights [L,H,D]{'' if self.joint else ', basis [L,H,D,D]'}, little-endian float32"
        ]
        if self.joint:
            order.append("basis [L,R,R] float16, R = 2 H D")
        order.append("freqs [C,256] u16, recon [C,256] float32")
        if self.predicted:
            order.append(
                {
                    2: "predictor [L,P,P] float16, P = 2 H predicted",
                    3: "predictor [L,P,Q] float16, P = 2 H predicted, Q = 2 H inputs",
                }.get(version, "predictor [L,P,Q] float16")
            )
        header: dict[str, Any] = {
            "format": "kvdb-entropy-coded",
            "layers": self.layers,
            "heads": self.heads,
            "dim": self.dim,
            "pre_rope": self.pre_rope,
            "preset": self.preset,
            "step": self.step,
            "rounding": self.rounding,
            "classes": {kind: self.classes[kind].tolist() for kind in self.classes},
            "order": "; then ".join(order),
            "meta": self.meta,
        }
        if self.predicted:
            header["predicted"] = self.predicted
        if version >= 3:
            header["inputs"] = self.prediction_inputs
        if self.joint:
            header["joint"] = True
        per_kind = (self.centre, self.weights) if self.joint else (self.centre, self.weights, self.basis)
        parts = [np.ascontiguousarray(a[kind], dtype="<f4").tobytes() for kind in KINDS for a in per_kind]
        if self.joint:
            # trained as float16 values: no loss
            parts.append(np.ascontiguousarray(self.basis[JOINT], dtype="<f2").tobytes())
        parts += [
            np.ascontiguousarray(self.freqs, dtype="<u2").tobytes(),
            np.ascontiguousarray(self.recon, dtype="<f4").tobytes(),
        ]
        if self.predicted:
            # trained as float16 values: no loss
            parts.append(np.ascontiguousarray(self.predictor, dtype="<f2").tobytes())
        return framing.frame(MAGIC, version, header, parts)

    @classmethod
    def from_bytes(cls, blob: bytes) -> EntropyCodebooks:
        blob = bytes(blob)
        _, header, at = framing.unframe(blob, MAGIC, VERSION, "entropy-coded codebook")
        layers, heads, dim = header["layers"], header["heads"], header["dim"]
        joint, rows = bool(header.get("joint", False)), 2 * heads * dim
        classes: dict[str, np.ndarray]
        if joint:
            classes = {JOINT: np.asarray(header["classes"][JOINT], np.int32).reshape(layers, rows)}
        else:
            classes = {
                kind: np.asarray(header["classes"][kind], np.int32).reshape(layers, heads, dim) for kind in KINDS
            }
        arrays: dict[str, dict[str, np.ndarray]] = {"centre": {}, "weights": {}, "basis": {}}
        payload = framing.Arrays(blob, at, "entropy-coded codebook")
        for kind in KINDS:
            for name, shape in (
                ("centre", (layers, heads, dim)),
                ("weights", (layers, heads, dim)),
                ("basis", (layers, heads, dim, dim)),
            ):
                if not (joint and name == "basis"):
                    arrays[name][kind] = payload.take("<f4", shape).astype(np.float32)
        if joint:
            arrays["basis"][JOINT] = payload.take("<f2", (layers, rows, rows)).astype(np.float32)
        freqs = payload.take("<u2", (CLASSES, 256)).astype(np.uint16)
        recon = payload.take("<f4", (CLASSES, 256)).astype(np.float32)
        predicted = int(header.get("predicted", 0))
        inputs = int(header.get("inputs", predicted))
        shape = (layers, predicted, inputs) if joint else (layers, 2 * heads * predicted, 2 * heads * inputs)
        predictor = payload.take("<f2", shape).astype(np.float32) if predicted else np.zeros((0, 0, 0), np.float32)
        payload.done()
        return cls(
            layers,
            heads,
            dim,
            header["pre_rope"],
            header["preset"],
            arrays["centre"],
            arrays["weights"],
            arrays["basis"],
            float(header["step"]),
            float(header["rounding"]),
            classes,
            freqs,
            recon,
            header["meta"],
            predicted,
            predictor,
            inputs if inputs != predicted else 0,
            joint,
        )


def quantize(y: np.ndarray, step: float, rounding: float = ROUNDING) -> np.ndarray:
    """``sign(y) * floor(|y| / step + rounding)``, int16 (saturated)."""
    q = np.floor(np.abs(y) / step + rounding)
    return (np.sign(y) * np.minimum(q, 32767)).astype(np.int16)


def predicted_rows(heads: int, dim: int, predicted: int, joint: bool = False) -> np.ndarray:
    """A layer's rows (stream order) that are predicted: each head's first ``predicted`` (rows
    kind > head > coefficient), or the layer's first ``predicted`` if ``joint``."""
    if joint:
        return np.arange(predicted)
    return (np.arange(2 * heads)[:, None] * dim + np.arange(predicted)).reshape(-1)


def closed_loop(
    y: np.ndarray,
    predictor: np.ndarray,
    rows: np.ndarray,
    step: float,
    rounding: float,
    value_of: Callable[[int, np.ndarray], np.ndarray],
    fed: np.ndarray | None = None,
) -> np.ndarray:
    """Integers int16 of coefficients ``y`` ``[layers, rows, n]``, each layer's ``rows`` less their
    prediction from the previous layer's ``rows[fed]`` (default: all of ``rows``) as the decoder
    will have them (``value_of(layer, integers)`` of those rows, plus their own prediction). ``y``
    is left holding what was coded: the coefficients less their predictions."""
    if not len(rows):
        return quantize(y, step, rounding)
    index = _as_slice(rows)
    q, decoded = np.empty(y.shape, np.int16), None
    for layer in range(len(y)):
        prediction = None if decoded is None else predictor[layer] @ decoded
        if prediction is not None:
            y[layer, index] -= prediction
        q[layer] = quantize(y[layer], step, rounding)
        decoded = value_of(layer, q[layer, index])
        if prediction is not None:
            decoded += prediction
        if fed is not None:
            decoded = decoded[fed]
    return q


def _as_slice(rows: np.ndarray) -> slice | np.ndarray:
    """``rows`` as a slice where they are one run (every row of a ``p64`` set of 64-dimensional
    heads, or a joint set's first rows), so that indexing with them is a view, not a copy of the
    layer; else as they are."""
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows) and bool((np.diff(rows) == 1).all()):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows
