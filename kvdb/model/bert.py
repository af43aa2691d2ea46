"""A BERT encoder's forward pass in numpy, for the semantic tier's embedder.

Importing torch and transformers costs a command seconds before its first vector; the default
embedder (all-MiniLM-L6-v2) is a 6-layer BERT, whose forward pass is a few matrix products
numpy runs as fast. It covers BERT-family checkpoints as transformers' ``BertModel`` runs them
(``model_type`` "bert": learned absolute positions, post-LayerNorm, exact GELU) stored in one
``model.safetensors``: MiniLM, bge, e5, gte and most sentence-transformers models. Anything else
(MPNet's relative positions, RoBERTa's position offset, sharded, ``.bin`` or bfloat16 weights, a decoder)
is run by transformers; ``covers`` says which.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

WEIGHTS = "model.safetensors"


def covers(folder: Path, config: dict) -> bool:
    """Whether this forward pass computes what ``BertModel`` computes for the checkpoint in ``folder``."""
    return (
        config.get("model_type") == "bert"
        and config.get("hidden_act", "gelu") == "gelu"
        and config.get("position_embedding_type", "absolute") == "absolute"
        and not config.get("is_decoder", False)
        and (folder / WEIGHTS).is_file()
        and all(t["dtype"] in DTYPES for t in header(folder / WEIGHTS)[0].values())
    )


class Bert:
    """The encoder's weights as float32 arrays, and ``__call__``: token ids and their padding
    mask in, the last hidden states out."""

    def __init__(self, folder: Path, config: dict):
        weights = mapped(folder / WEIGHTS)
        # a checkpoint saved from BertFor*
        prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""

        def w(name: str) -> np.ndarray:
            return weights[prefix + name].astype(np.float32, copy=False)

        def linear_(name: str) -> tuple[np.ndarray, np.ndarray]:
            """(W, b) with W a transposed view, so each product reads x @ W (BLAS takes it as it is)."""
            return w(f"{name}.weight").T, w(f"{name}.bias")

        def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
            return w(f"{name}.LayerNorm.weight"), w(f"{name}.LayerNorm.bias")

        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.word, self.position, self.token_type = (
            w(f"embeddings.{n}_embeddings.weight") for n in ("word", "position", "token_type")
        )
        self.embed_norm = norm("embeddings")
        self.layers = [
            {
                "q": linear_(f"{at}.attention.self.query"),
                "k": linear_(f"{at}.attention.self.key"),
                "v": linear_(f"{at}.attention.self.value"),
                "o": linear_(f"{at}.attention.output.dense"),
                "attn_norm": norm(f"{at}.attention.output"),
                "up": linear_(f"{at}.intermediate.dense"),
                "down": linear_(f"{at}.output.dense"),
                "ffn_norm": norm(f"{at}.output"),
            }
            for at in (f"encoder.layer.{i}" for i in range(int(config["num_hidden_layers"])))
        ]

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """[B, T] token ids and [B, T] mask (1: a token, 0: padding) -> [B, T, D] float32 hidden states.
        Every token is of segment 0 (one text per row, as sentence-transformers feeds them)."""
        b, t = ids.shape
        x = self.word[ids] + self.position[:t] + self.token_type[0]
        x = layer_norm(x, *self.embed_norm, self.eps)
        # a padded key gets -inf-like logits: no query attends to it (transformers adds float32's min likewise)
        blocked = np.where(mask[:, None, None, :] > 0, 0.0, np.finfo(np.float32).min).astype(np.float32)
        for layer in self.layers:
            x = layer_norm(x + linear(self.attention(x, layer, blocked), *layer["o"]), *layer["attn_norm"], self.eps)
            x = layer_norm(x + linear(gelu(linear(x, *layer["up"])), *layer["down"]), *layer["ffn_norm"], self.eps)
        return x

    def attention(self, x: np.ndarray, layer: dict, blocked: np.ndarray) -> np.ndarray:
        """softmax(q k^T / sqrt(d) + blocked) v per head, the heads concatenated again."""
        b, t, d = x.shape
        q, k, v = (linear(x, *layer[n]).reshape(b, t, self.heads, d // self.heads) for n in "qkv")
        # einsum reaches BLAS per head; numpy's stacked matmul of [B, H, T, d] did not (5x slower)
        # the scale on q, the mask added in place: [B, H, T, T] is the largest array, each pass over it costs
        scores = np.einsum("bqhd,bkhd->bhqk", q / np.float32(math.sqrt(d // self.heads)), k, optimize=True)
        scores += blocked
        return np.einsum("bhqk,bkhd->bqhd", softmax(scores), v, optimize=True).reshape(b, t, d)


def header(path: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors (dtype, shape, byte range) and where their data starts: an
    8-byte little-endian length, then that many bytes of JSON."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        tensors = json.loads(f.read(size))
    tensors.pop("__metadata__", None)
    return tensors, 8 + size


def mapped(path: Path) -> dict[str, np.ndarray]:
    """The tensors as read-only views of the file mapped into memory: a query reads the rows of
    the word embeddings it uses, not the whole file (45 of all-MiniLM-L6-v2's 87 MB)."""
    tensors, base = header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return {
        name: data[base + t["data_offsets"][0] : base + t["data_offsets"][1]]
        .view(DTYPES[t["dtype"]])
        .reshape(t["shape"])
        for name, t in tensors.items()
    }


DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
}  # bf16 has no numpy type: such a checkpoint runs by transformers


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """x @ W + b over the last axis (one matrix product over every token of the batch)."""
    return (x.reshape(-1, x.shape[-1]) @ weight + bias).reshape(*x.shape[:-1], weight.shape[1])


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + np.float32(eps)) * gain + bias


def softmax(x: np.ndarray) -> np.ndarray:
    e = x - x.max(-1, keepdims=True)
    np.exp(e, out=e)  # in place: [B, H, T, T] is the largest array of the pass
    e /= e.sum(-1, keepdims=True)
    return e


def gelu(x: np.ndarray) -> np.ndarray:
    """x Phi(x) = x/2 (1 + erf(x/sqrt 2)), BERT's exact GELU (not the tanh approximation). numpy
    has no erf (and scipy is no dependency): Abramowitz & Stegun 7.1.26, erf(a) = 1 - p(t) exp(-a^2)
    with t = 1/(1 + P a) for a >= 0, |error| < 1.5e-7, below float32's resolution of the output.
    In place, as the largest arrays of the pass are these: fresh temporaries cost more than the arithmetic."""
    a = np.abs(x) * np.float32(1 / math.sqrt(2.0))
    t = a * np.float32(_P)
    t += 1.0
    np.reciprocal(t, out=t)
    poly = t * np.float32(_A[4])
    for coefficient in _A[3::-1]:
        poly += coefficient
        poly *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a  # 1 - erf(|x|/sqrt 2)
    # x Phi(x): x (1 - poly/2) for x >= 0, x poly/2 for x < 0
    poly *= 0.5
    np.subtract(1.0, poly, out=poly, where=x >= 0)
    poly *= x
    return poly


_P = 0.3275911
_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
