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

import copy
import decimal
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from kvdb.errors import UnsupportedModel
from kvdb.model import integer_kernel

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
# in r**2, times r; |r| <= pi/4
_SIN_COEFFS = _series([Fraction((-1) ** k, math.factorial(2 * k + 1)) for k in range(10)])
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
        return np.array(
            [float((-(decimal.Decimal(2 * i) / dim) * log_theta).exp()) for i in range(dim // 2)], dtype=np.float64
        )


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
    """int8 weights ``[out, in]`` (each row quantized alone) with per-output scales, and a bias."""

    weight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float64 [out]
    bias: torch.Tensor | None = None
    _columns: torch.Tensor | None = field(default=None, repr=False)  # float32 [in, out], made on first reference call

    @classmethod
    def of(cls, *modules) -> Linear:
        """The modules' weights quantized and stacked by output (q, k and v share one matmul)."""
        w = torch.cat([m.weight.detach().to(torch.float64) for m in modules])
        q, s = quantize_rows(w, WEIGHT_LIMIT)
        biases = [m.bias for m in modules]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach().to(torch.float64)
                    if b is not None
                    else torch.zeros(m.weight.shape[0], dtype=torch.float64)
                    for b, m in zip(biases, modules)
                ]
            )
        )
        return cls(q.to(torch.int8).contiguous(), s[:, 0].contiguous(), None if bias is None else bias.contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._columns is None:
            self._columns = self.weight.t().to(torch.float32).contiguous()
        q, s = quantize_rows(x)
        high = torch.floor((q + 128) / 256)
        both = torch.cat([high, q - high * 256]).to(torch.float32)  # [2 rows, in]: bytes in [-128, 127]
        acc = None
        for a in range(0, both.shape[1], KCHUNK):
            part = (both[:, a : a + KCHUNK] @ self._columns[a : a + KCHUNK]).to(torch.float64)
            acc = part if acc is None else acc + part
        assert acc is not None  # a layer has at least one input column
        rows = x.shape[0]
        y = ((acc[:rows] * 256 + acc[rows:]) * s) * self.scale
        return y if self.bias is None else y + self.bias


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root IEEE 754 requires. Not ``torch.sqrt``: for contiguous
    float64 tensors it calls a vector math library that is off by one ulp in about 1% of values
    (measured on this machine's torch 2.13 build), and such a library may differ by CPU."""
    return torch.from_numpy(np.sqrt(x.numpy()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, root=sqrt) -> torch.Tensor:
    q, s = quantize_rows(x)
    mean_square = (((q * q).sum(-1, keepdim=True) / x.shape[-1]) * s) * s
    return (x * (1 / root(mean_square + eps))) * weight


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


class Cache:
    """Every layer's quantized keys and values: integers (int16 ``[layers, kv_heads, capacity,
    head_dim]``) and their scales (float64 ``[layers, kv_heads, capacity]``), in buffers that
    double when full. The reference pass and the kernel read and write the same layout."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.length = 0
        self.k = torch.zeros((layers, kv_heads, 0, head_dim), dtype=torch.int16)
        self.v = torch.zeros_like(self.k)
        self.ks = torch.zeros((layers, kv_heads, 0), dtype=torch.float64)
        self.vs = torch.zeros_like(self.ks)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, end: int) -> None:
        """Room for positions up to ``end`` (the ones held are kept)."""
        if end <= self.capacity:
            return
        grown = max(64, 2 * self.capacity, end)
        for name in ("k", "v", "ks", "vs"):
            old = getattr(self, name)
            new = torch.zeros(old.shape[:2] + (grown,) + old.shape[3:], dtype=old.dtype)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


class IntegerLM:
    """The deterministic forward pass of one model (weights quantized once, at construction)."""

    def __init__(self, model, *, kernel: bool = True):
        """``kernel=False`` runs the reference pass of this module even where the compiled
        kernel (kvdb/model/integer_kernel.c, the same bits, many times faster) is built."""
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
                Linear.of(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                Linear.of(layer.self_attn.o_proj),
                Linear.of(layer.mlp.gate_proj, layer.mlp.up_proj),
                Linear.of(layer.mlp.down_proj),
                layer.input_layernorm.weight.detach().to(torch.float64),
                layer.post_attention_layernorm.weight.detach().to(torch.float64),
            )
            for layer in inner.layers
        ]
        self.norm = inner.norm.weight.detach().to(torch.float64)
        self.head = Linear.of(model.lm_head)
        self.inv_freq = inverse_frequencies(float(_rope(cfg)["rope_theta"]), self.head_dim)
        self.vocab = int(model.lm_head.weight.shape[0])
        self._tables = (torch.zeros(0, self.head_dim // 2, dtype=torch.float64),) * 2
        self.root: Callable[[torch.Tensor], torch.Tensor] = sqrt
        self.kernel = integer_kernel.Kernel.of(self, _EXP_TABLE, _EXP_COEFFS) if kernel else None

    def with_torch_sqrt(self) -> IntegerLM:
        """The pass of tier-L payload version 2, which took its norms' square roots from
        ``torch.sqrt`` (see :func:`sqrt`), sharing this one's weights. Only the reference pass
        computes it: version-2 payloads decode where they decoded before, slowly."""
        legacy = copy.copy(self)
        legacy.root, legacy.kernel = torch.sqrt, None
        return legacy

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this model has no deterministic forward here (None when it has one)."""
        cfg = getattr(model, "config", None)
        name = getattr(cfg, "model_type", type(model).__name__)
        if name != "llama" or not hasattr(getattr(model, "model", None), "layers") or not hasattr(model, "lm_head"):
            return (
                "tier L's deterministic forward (payload version 3) covers Llama-family models; "
                f"{type(model).__name__} ({name}) is not one"
            )
        rope = _rope(cfg)
        if rope.get("rope_type", "default") != "default":
            return (
                f"the deterministic forward covers the default rotary embedding, not {rope.get('rope_type')!r} scaling"
            )
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return "the deterministic forward covers SiLU MLPs without biases"
        if getattr(cfg, "pretraining_tp", 1) not in (1, None):
            return "the deterministic forward does not cover tensor-parallel weight slicing"
        return None

    def new_cache(self) -> Cache:
        return Cache(len(self.layers), self.kv_heads, self.head_dim)

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
        cache.reserve(cache.length + len(ids))
        cos, sin = self._rotary(cache.length + len(ids))
        run = self.kernel.forward if self.kernel is not None else self._reference
        logits = run(self.embed[ids], cache, cos, sin)
        cache.length += len(ids)
        return logits

    def _reference(self, h: torch.Tensor, cache: Cache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, start = h.shape[0], cache.length
        cos, sin = cos[start : start + n, None], sin[start : start + n, None]  # [n, 1, dim/2]
        causal = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, keys]
        for i, layer in enumerate(self.layers):
            h = h + layer.out(
                self._attention(layer, i, rms_norm(h, layer.attn_norm, self.eps, self.root), cache, cos, sin, causal)
            )
            gate, up = layer.gate_up(rms_norm(h, layer.mlp_norm, self.eps, self.root)).chunk(2, dim=-1)
            h = h + layer.down(silu(gate) * up)
        return self.head(rms_norm(h, self.norm, self.eps, self.root))

    def _attention(self, layer: Layer, index: int, x: torch.Tensor, cache: Cache, cos, sin, causal) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        start, end = cache.length, cache.length + n
        q, k, v = layer.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = _rotate(q.reshape(n, self.heads, d), cos, sin)
        k = _rotate(k.reshape(n, self.kv_heads, d), cos, sin)
        kq, ks = quantize_rows(k.transpose(0, 1))  # [kv_heads, n, d], [kv_heads, n, 1]
        vq, vs = quantize_rows(v.reshape(n, self.kv_heads, d).transpose(0, 1))
        cache.k[index, :, start:end], cache.ks[index, :, start:end] = kq.to(torch.int16), ks[..., 0]
        cache.v[index, :, start:end], cache.vs[index, :, start:end] = vq.to(torch.int16), vs[..., 0]
        keys, key_scales = cache.k[index, :, :end].to(torch.float64), cache.ks[index, :, :end, None]
        values, value_scales = cache.v[index, :, :end].to(torch.float64), cache.vs[index, :, :end, None]
        group = self.heads // self.kv_heads
        # query heads by the KV head they read
        qq, qs = quantize_rows(q.transpose(0, 1).reshape(self.kv_heads, group * n, d))
        scores = ((qq @ keys.transpose(1, 2)) * qs) * key_scales.transpose(1, 2)  # [kv_heads, group * n, keys]
        scores = (scores * (1 / math.sqrt(d))).reshape(self.kv_heads, group, n, -1)
        allowed = causal[None, None]
        top = torch.where(allowed, scores, -math.inf).amax(-1, keepdim=True)
        e = torch.where(allowed, exp_nonpositive(scores - top), 0.0)
        weighted = e * value_scales.transpose(1, 2)[:, None]  # e_j * s_j: each key's weight on its integer value row
        per_one = ATTN_ONE / weighted.amax(-1, keepdim=True)
        w = torch.round(weighted * per_one).reshape(self.kv_heads, group * n, -1)
        total = torch.round(e * ATTN_ONE).sum(-1, keepdim=True).reshape(self.kv_heads, group * n, 1)
        # [kv_heads, group * n, d]
        out = ((w @ values) / per_one.reshape(self.kv_heads, group * n, 1)) / (total / ATTN_ONE)
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
