"""A forward pass whose every result is a function of the weights and tokens alone: the same on
any CPU, instruction set, BLAS, thread count and batch shape (tier L v2, docs/formats.md).

A float forward pass is not: a matmul's sums run in an order its kernel picks, and ``exp`` comes
from a library. Here only three kinds of operation are used:

* **integer sums.** Every reduction (matmuls, norms' sums of squares, softmax's normaliser)
  adds integers held exactly in floats: float32 while every partial sum stays below 2**24,
  float64 below 2**53. Integer addition is associative, so any order, blocking, FMA or thread
  split gives the same bits.
* **elementwise IEEE-754 operations** in binary64: ``+ - * /``, ``sqrt``, rounding to an
  integer, comparisons. IEEE 754 rounds each of them correctly, so scalar and SIMD code agree.
* **``exp``, ``cos`` and ``sin``** as the fixed polynomials below, built from those operations
  (no libm), and ``theta ** x`` of the rotary frequencies computed once in decimal arithmetic.

The quantities that enter the integer sums are quantized:

* weights per output row to int8 (``round(w / s)``, ``s = max |w| / 127``);
* a linear layer's input per row to 16 bits, split into a high and a low byte so each half meets
  the int8 weights in a float32 matmul whose sums stay below 2**24 (inputs over ``KCHUNK`` wide
  are summed in slices of it);
* attention's queries, keys and values per (position, head) row to 16 bits;
* attention weights to 16 bits each, over the keys of their row.

A row's quantization depends on that row alone, so a batched pass over a chunk of tokens gives
bit for bit what one-token steps give, and an encoder can use the batched pass while a decoder
steps. The Llama family is supported (``IntegerLM.unsupported`` says why another model is not).
"""

from __future__ import annotations

import decimal
import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from kvdb.errors import UnsupportedModel

ACT_LIMIT = 32639  # 16-bit rows: |q| <= 127 * 256 + 127, so the high byte is in [-127, 127]
WEIGHT_LIMIT = 127
KCHUNK = 1024  # 128 * 127 * 1024 < 2**24: a float32 matmul over this many terms is exact
ATTN_ONE = 65536.0  # attention weights are integers up to this
_EXP_FLOOR = -80.0  # exp below e**-80 is taken as e**-80 (and masked keys as 0): no subnormals

# fdlibm's splits of ln 2 and pi/2 into parts whose products with small integers are exact
_LN2_64_HI = float.fromhex("0x1.62e42feep-7")  # ln2/64: fdlibm's split of ln 2, over 64 (exact)
_LN2_64_LO = float.fromhex("0x1.a39ef35793c76p-39")
_INV_LN2_64 = float.fromhex("0x1.71547652b82fep+6")
_PIO2 = (float.fromhex("0x1.921fb544p+0"), float.fromhex("0x1.0b4611a6p-34"), float.fromhex("0x1.3198a2e037073p-69"))
_INV_PIO2 = float.fromhex("0x1.45f306dc9c883p-1")


def _series(terms: list[Fraction]) -> list[float]:
    """A polynomial's coefficients, highest power first (Horner order), each rounded once."""
    return [float(c) for c in reversed(terms)]


_EXP_COEFFS = _series([Fraction(1, math.factorial(k)) for k in range(4)])  # |r| <= ln2/128
_SIN_COEFFS = _series([Fraction((-1) ** k, math.factorial(2 * k + 1)) for k in range(10)])  # in r**2, times r; |r| <= pi/4
_COS_COEFFS = _series([Fraction((-1) ** k, math.factorial(2 * k)) for k in range(11)])  # in r**2


def _powers_of_two_64ths() -> torch.Tensor:
    """2**(j/64) for j < 64, each computed to 40 digits and rounded once."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        ln2 = decimal.Decimal(2).ln()
        return torch.tensor([float((ln2 * j / 64).exp()) for j in range(64)], dtype=torch.float64)


_EXP_TABLE = _powers_of_two_64ths()


def _horner(x, coeffs):
    acc = x * 0 + coeffs[0]
    for c in coeffs[1:]:
        acc = acc * x + c
    return acc


def exp_nonpositive(d: torch.Tensor) -> torch.Tensor:
    """exp of float64 values <= 0: d = (64 m + j) ln2/64 + r with |r| <= ln2/128, so
    exp(d) = 2**m * 2**(j/64) * exp(r): a power of two built from its bits (exact), a table of
    64 constants, and a cubic (relative error below 4e-11, far under the 2**-16 of the attention
    weights it feeds)."""
    d = torch.clamp(d, _EXP_FLOOR, 0.0)  # above 0 only where a caller masks the result away
    k = torch.round(d * _INV_LN2_64)
    r = (d - k * _LN2_64_HI) - k * _LN2_64_LO
    k = k.to(torch.int64)
    power = (((k >> 6) + 1023) << 52).view(torch.float64)  # k >> 6 floors: 2**m, m = floor(k / 64)
    return (_horner(r, _EXP_COEFFS) * _EXP_TABLE[k & 63]) * power


def cos_sin(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of float64 angles in [0, 2**20): reduction by pi/2 in three exact parts, then
    Taylor polynomials on [-pi/4, pi/4]."""
    x = np.asarray(x, dtype=np.float64)
    k = np.rint(x * _INV_PIO2)
    r = ((x - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    sin_r, cos_r = r * _horner(r2, _SIN_COEFFS), _horner(r2, _COS_COEFFS)
    quadrant = k.astype(np.int64) % 4
    sin = np.choose(quadrant, [sin_r, cos_r, -sin_r, -cos_r])
    cos = np.choose(quadrant, [cos_r, -sin_r, -cos_r, sin_r])
    return cos, sin


def inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """theta ** (-2i / dim) for i < dim/2, each computed to 40 digits and rounded once."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        log_theta = decimal.Decimal(theta).ln()
        return np.array([float((-(decimal.Decimal(2 * i) / dim) * log_theta).exp()) for i in range(dim // 2)], dtype=np.float64)


# ------------------------------------------------------------------------------------------
# quantized operands
# ------------------------------------------------------------------------------------------


def quantize_rows(x: torch.Tensor, limit: float = ACT_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s): integers |q| <= limit (float64) and per-row scales with x ~ q * s (last axis)."""
    peak = x.abs().amax(-1, keepdim=True)
    scale = torch.where(peak > 0, peak / limit, torch.ones_like(peak))
    return torch.round(x / scale), scale


@dataclass
class Linear:
    """int8 weights ``[in, out]`` (float32, each an integer) with per-output scales, and a bias."""

    weight: torch.Tensor
    scale: torch.Tensor  # float64 [out]
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, *modules) -> Linear:
        """The modules' weights quantized and stacked by output (q, k and v share one matmul)."""
        w = torch.cat([m.weight.detach().to(torch.float64) for m in modules])
        q, s = quantize_rows(w, WEIGHT_LIMIT)
        biases = [m.bias for m in modules]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach().to(torch.float64) if b is not None else torch.zeros(m.weight.shape[0], dtype=torch.float64) for b, m in zip(biases, modules)]
        )
        return cls(q.t().contiguous().to(torch.float32), s[:, 0], bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows(x)
        high = torch.floor((q + 128) / 256)
        both = torch.cat([high, q - high * 256]).to(torch.float32)  # [2 rows, in]: bytes in [-128, 127]
        acc = None
        for a in range(0, both.shape[1], KCHUNK):
            part = (both[:, a : a + KCHUNK] @ self.weight[a : a + KCHUNK]).to(torch.float64)
            acc = part if acc is None else acc + part
        rows = x.shape[0]
        y = ((acc[:rows] * 256 + acc[rows:]) * s) * self.scale
        return y if self.bias is None else y + self.bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    q, s = quantize_rows(x)
    mean_square = (((q * q).sum(-1, keepdim=True) / x.shape[-1]) * s) * s
    return (x * (1 / torch.sqrt(mean_square + eps))) * weight


def silu(x: torch.Tensor) -> torch.Tensor:
    e = exp_nonpositive(-x.abs())
    return x * torch.where(x >= 0, 1 / (1 + e), e / (1 + e))


# ------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------


@dataclass
class Layer:
    qkv: Linear
    out: Linear
    gate_up: Linear
    down: Linear
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor


@dataclass
class Cache:
    """Each layer's quantized keys and values (integers ``[kv_heads, positions, head_dim]`` and
    scales ``[kv_heads, positions, 1]``), in buffers that double when full."""

    length: int = 0
    layers: list[list[torch.Tensor]] = field(default_factory=list)  # per layer: [k, k_scale, v, v_scale]

    def append(self, layer: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Add ``parts`` (new positions on axis 1) after ``self.length``; the layer's parts so far."""
        n = parts[0].shape[1]
        if layer == len(self.layers):
            self.layers.append([torch.empty((p.shape[0], max(64, n), p.shape[2]), dtype=p.dtype) for p in parts])
        held = self.layers[layer]
        if self.length + n > held[0].shape[1]:
            grown = max(2 * held[0].shape[1], self.length + n)
            for i, p in enumerate(held):
                bigger = torch.empty((p.shape[0], grown, p.shape[2]), dtype=p.dtype)
                bigger[:, : self.length] = p[:, : self.length]
                held[i] = bigger
        for p, new in zip(held, parts):
            p[:, self.length : self.length + n] = new
        return [p[:, : self.length + n] for p in held]


class IntegerLM:
    """The deterministic forward pass of one model (weights quantized once, at construction)."""

    def __init__(self, model):
        reason = self.unsupported(model)
        if reason:
            raise UnsupportedModel(reason)
        cfg = model.config
        inner = model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = float(cfg.rms_norm_eps)
        self.embed = inner.embed_tokens.weight.detach().to(torch.float64)
        self.layers = [
            Layer(
                Linear.of(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), Linear.of(l.self_attn.o_proj),
                Linear.of(l.mlp.gate_proj, l.mlp.up_proj), Linear.of(l.mlp.down_proj),
                l.input_layernorm.weight.detach().to(torch.float64), l.post_attention_layernorm.weight.detach().to(torch.float64),
            )
            for l in inner.layers
        ]
        self.norm = inner.norm.weight.detach().to(torch.float64)
        self.head = Linear.of(model.lm_head)
        self.inv_freq = inverse_frequencies(float(_rope(cfg)["rope_theta"]), self.head_dim)
        self.vocab = int(model.lm_head.weight.shape[0])
        self._tables = (torch.zeros(0, self.head_dim // 2, dtype=torch.float64),) * 2

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this model has no deterministic forward here (None when it has one)."""
        cfg = getattr(model, "config", None)
        name = getattr(cfg, "model_type", type(model).__name__)
        if name != "llama" or not hasattr(getattr(model, "model", None), "layers") or not hasattr(model, "lm_head"):
            return f"the deterministic forward of tier L v2 covers Llama-family models; {type(model).__name__} ({name}) is not one"
        rope = _rope(cfg)
        if rope.get("rope_type", "default") != "default":
            return f"the deterministic forward covers the default rotary embedding, not {rope.get('rope_type')!r} scaling"
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return "the deterministic forward covers SiLU MLPs without biases"
        if getattr(cfg, "pretraining_tp", 1) not in (1, None):
            return "the deterministic forward does not cover tensor-parallel weight slicing"
        return None

    def new_cache(self) -> Cache:
        return Cache()

    def _rotary(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[positions, head_dim / 2]`` of positions up to ``end`` (grown in doublings)."""
        if self._tables[0].shape[0] < end:
            positions = np.arange(max(end, 2 * self._tables[0].shape[0]), dtype=np.float64)
            cos, sin = cos_sin(positions[:, None] * self.inv_freq[None, :])
            self._tables = torch.from_numpy(cos), torch.from_numpy(sin)
        return self._tables

    @torch.no_grad()
    def forward(self, ids, cache: Cache) -> torch.Tensor:
        """Logits (float64 ``[len(ids), vocab]``) of each next token, the cache extended by ``ids``."""
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        n, start = len(ids), cache.length
        cos, sin = self._rotary(start + n)
        cos, sin = cos[start : start + n, None], sin[start : start + n, None]  # [n, 1, dim/2]
        causal = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, keys]
        h = self.embed[ids]
        for i, layer in enumerate(self.layers):
            h = h + layer.out(self._attention(layer, i, rms_norm(h, layer.attn_norm, self.eps), cache, cos, sin, causal))
            gate, up = layer.gate_up(rms_norm(h, layer.mlp_norm, self.eps)).chunk(2, dim=-1)
            h = h + layer.down(silu(gate) * up)
        cache.length += n
        return self.head(rms_norm(h, self.norm, self.eps))

    def _attention(self, layer: Layer, index: int, x: torch.Tensor, cache: Cache, cos, sin, causal) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = layer.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = _rotate(q.reshape(n, self.heads, d), cos, sin)
        k = _rotate(k.reshape(n, self.kv_heads, d), cos, sin)
        kq, ks = quantize_rows(k.transpose(0, 1))  # [kv_heads, n, d], [kv_heads, n, 1]
        vq, vs = quantize_rows(v.reshape(n, self.kv_heads, d).transpose(0, 1))
        keys, key_scales, values, value_scales = cache.append(index, [kq, ks, vq, vs])
        group = self.heads // self.kv_heads
        qq, qs = quantize_rows(q.transpose(0, 1).reshape(self.kv_heads, group * n, d))  # query heads by the KV head they read
        scores = ((qq @ keys.transpose(1, 2)) * qs) * key_scales.transpose(1, 2)  # [kv_heads, group * n, keys]
        scores = (scores * (1 / math.sqrt(d))).reshape(self.kv_heads, group, n, -1)
        allowed = causal[None, None]
        top = torch.where(allowed, scores, -math.inf).amax(-1, keepdim=True)
        e = torch.where(allowed, exp_nonpositive(scores - top), 0.0)
        weighted = e * value_scales.transpose(1, 2)[:, None]  # e_j * s_j: each key's weight on its integer value row
        per_one = ATTN_ONE / weighted.amax(-1, keepdim=True)
        w = torch.round(weighted * per_one).reshape(self.kv_heads, group * n, -1)
        total = torch.round(e * ATTN_ONE).sum(-1, keepdim=True).reshape(self.kv_heads, group * n, 1)
        out = ((w @ values) / per_one.reshape(self.kv_heads, group * n, 1)) / (total / ATTN_ONE)  # [kv_heads, group * n, d]
        return out.reshape(self.kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, self.heads * d)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[n, heads, dim]``: the halves' pairs (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope(cfg) -> dict:
    found = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if "rope_theta" not in found and getattr(cfg, "rope_theta", None) is not None:
        found = {**found, "rope_theta": cfg.rope_theta}
    return found
