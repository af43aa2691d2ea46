"""The compiled fast path of :mod:`kvdb.model.integer_lm` (``kvdb/model/integer_kernel.c``), bound with ctypes.

The C file computes the reference pass's equations with exact integer sums and the same IEEE-754
operations in the same order, so its logits are the reference's bit for bit (tests check it on
every text they run) while a one-token step costs one call instead of thousands of small torch
operations. It is built by ``pip install`` as the extension ``kvdb.model._integer_kernel``; where it is
missing (no compiler when kvdb was installed) :class:`Kernel.of` returns None and the reference
pass runs: slower, the same payloads.

``KVDB_INTEGER_SIMD=0`` makes the kernel use its plain C dot products instead of AVX2 ones
(the same integers; tests use it to show that).
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, Structure, c_char_p, c_double, c_int, c_int64, c_void_p

import torch

from kvdb.errors import Busy


class _Linear(Structure):
    _fields_ = [
        ("inputs", c_int64),
        ("outputs", c_int64),
        ("weight", c_void_p),
        ("scale", c_void_p),
        ("bias", c_void_p),
    ]


class _Layer(Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("out", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("attn_norm", c_void_p),
        ("mlp_norm", c_void_p),
    ]


class _Model(Structure):
    _fields_ = [
        *[
            (name, c_int64)
            for name in ("n_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "threads")
        ],
        ("eps", c_double),
        ("layers", POINTER(_Layer)),
        ("head", _Linear),
        ("norm", c_void_p),
        ("exp_table", c_void_p),
        ("exp_coeffs", c_void_p),
    ]


class _Cache(Structure):
    _fields_ = [("capacity", c_int64), ("k", c_void_p), ("v", c_void_p), ("ks", c_void_p), ("vs", c_void_p)]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The built kernel and the dot products it chose ("avx2" or "plain"), or (None, why not)."""
    try:
        import kvdb.model._integer_kernel as _integer_kernel
    except ImportError as exc:
        return None, f"kvdb.model._integer_kernel is not built ({exc}); reinstall kvdb with a C compiler"
    lib = ctypes.CDLL(_integer_kernel.__file__)
    lib.kvdb_forward.restype = c_int
    lib.kvdb_forward.argtypes = [
        POINTER(_Model),
        POINTER(_Cache),
        c_int64,
        c_int64,
        c_void_p,
        c_void_p,
        c_void_p,
        c_void_p,
    ]
    lib.kvdb_kernel_isa.restype = c_char_p
    lib.kvdb_kernel_isa.argtypes = [c_int]
    isa = lib.kvdb_kernel_isa(0 if os.environ.get("KVDB_INTEGER_SIMD") == "0" else 1).decode()
    return lib, isa


_LIB, ISA = _load()  # ISA: the dot products in use, or why there is no kernel


def available() -> bool:
    return _LIB is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.is_contiguous(), "the kernel reads contiguous buffers"
    return t.data_ptr()


def _linear(lin) -> _Linear:
    out, inputs = lin.weight.shape
    return _Linear(inputs, out, _ptr(lin.weight), _ptr(lin.scale), _ptr(lin.bias))


class Kernel:
    """One model's weights as the kernel reads them (views of the IntegerLM's own tensors)."""

    def __init__(self, ilm, exp_table: torch.Tensor, exp_coeffs: list[float]):
        self._coeffs = torch.tensor(exp_coeffs, dtype=torch.float64)
        self._exp_table = exp_table.contiguous()
        self._layers = (_Layer * len(ilm.layers))(
            *[
                _Layer(
                    _linear(x.qkv),
                    _linear(x.out),
                    _linear(x.gate_up),
                    _linear(x.down),
                    _ptr(x.attn_norm),
                    _ptr(x.mlp_norm),
                )
                for x in ilm.layers
            ]
        )
        self._ilm = ilm  # keeps every buffer the structures point into alive
        self._model = _Model(
            len(ilm.layers),
            ilm.embed.shape[1],
            ilm.heads,
            ilm.kv_heads,
            ilm.head_dim,
            ilm.layers[0].gate_up.weight.shape[0] // 2,
            ilm.vocab,
            1,
            ilm.eps,
            self._layers,
            _linear(ilm.head),
            _ptr(ilm.norm),
            _ptr(self._exp_table),
            _ptr(self._coeffs),
        )

    @classmethod
    def of(cls, ilm, exp_table: torch.Tensor, exp_coeffs: list[float]) -> Kernel | None:
        """The kernel for ``ilm``, or None where it is not built or cannot take the model."""
        if _LIB is None or ilm.head_dim > 512 or ilm.heads % ilm.kv_heads:
            return None
        return cls(ilm, exp_table, exp_coeffs)

    def forward(self, h: torch.Tensor, cache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference pass's logits for the rows of embeddings ``h`` (a fresh tensor, which it
        overwrites) after ``cache.length`` positions; writes their keys and values into the cache (room
        reserved by the caller)."""
        h = h.contiguous()  # overwritten: the kernel keeps the residual stream in it
        n = h.shape[0]
        logits = torch.empty((n, self._model.vocab), dtype=torch.float64)
        self._model.threads = torch.get_num_threads()
        assert _LIB is not None  # a Kernel is only made where the library loaded
        held = _Cache(cache.capacity, _ptr(cache.k), _ptr(cache.v), _ptr(cache.ks), _ptr(cache.vs))
        status = _LIB.kvdb_forward(
            ctypes.byref(self._model), ctypes.byref(held), cache.length, n, _ptr(h), _ptr(cos), _ptr(sin), _ptr(logits)
        )
        if status != 0:
            raise Busy(
                f"tier L's integer kernel could not allocate its scratch memory for {n} positions "
                f"after {cache.length}: free memory and retry"
            )
        return logits
