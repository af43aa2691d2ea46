"""Tier L: a token stream entropy-coded against the model's own next-token distribution.

A range coder (``constriction``) spends about ``-log2 p(token | prefix)`` bits per token, so a
session costs the model's cross-entropy, and decoding rebuilds the KV cache as it goes: every
decoded token is fed to the model once, which both extends the cache and yields the next
distribution.

Determinism is the whole difficulty. The decoder must see *bit-identical* probabilities to the
encoder's, and it can only run the model one token at a time (it learns token i+1 only after
decoding it). A batched forward pass over many tokens rounds differently from a one-token pass
(other matmul kernels, other reduction orders), so the encoder cannot use the fast chunked pass
of ingest. Both sides therefore run the *same* step function (:func:`_step`: one token through
the model on top of the cache of every token before it, with torch pinned to one intra-op thread,
since the step rounds differently with 1 and 2 threads) and the same integer quantisation of its
logits (:func:`frequencies`). The state after a token sequence is thereby a function of the
sequence alone, not of how the sequence was cut into calls: coding ``prefix + suffix`` in one
call and coding ``suffix`` given the :class:`Context` of ``prefix`` see identical distributions.
That is what lets a trie node be coded given its parent's context.

Quantisation, chosen so that nothing after the model's float32 logits depends on libm or SIMD:

1. each logit is rounded to a grid of ``2**-LOGIT_SHIFT`` nats (float32 -> float64 times a power
   of two, then ``rint``: exact operations);
2. its distance ``d`` below the largest logit (an integer) indexes a table of integer weights
   ``~ 2**32 * exp(-d / 2**LOGIT_SHIFT)``, built by an integer recurrence from one hard-coded
   constant (no ``exp`` call, so the table is the same on every machine);
3. the weights are scaled to integer frequencies summing exactly to ``2**PRECISION`` with integer
   floor division, every symbol first given a floor frequency of 1 so any token is encodable;
   what rounding leaves over goes to the most probable symbol;
4. constriction's ``Categorical(perfect=False)`` receives these integers as float64 (exact) and
   maps them to its own 24-bit model, a deterministic function of exact inputs.

That is payload version 1, whose forward pass is the float model's own: a version-1 payload
decodes only with the same weights, and with a torch build and CPU that compute the one-token
step identically (``docs/decisions/0005-tier-l-one-token-step-determinism.md``). Version 3, the
default wherever :mod:`kvdb.model.integer_lm` covers the model, takes the logits from that module's
integer forward pass instead: the same on every machine, and batched chunks give the bits of
one-token steps, so the encoder runs chunks (:func:`_advance`) and only the decoder steps
(``docs/decisions/0025-tier-l-integer-forward.md``, ``0026-tier-l-integer-kernel.md``).
Version 2 is that pass with ``torch.sqrt`` in its norms, which is not correctly rounded on every
build: it is read (by the reference pass), never written. Either way a mismatch is never silent: a
"KL" payload carries a digest of the token stream, a node's id hashes its path's tokens, and
decoding raises :class:`~kvdb.errors.CorruptData`.

Two framings. A "KL" payload (:func:`encode`, :func:`decode`) describes itself: a header of 20-24
bytes, then constriction's range coder's 32-bit little-endian words::

    magic "KL" | version u8 (1, 2 or 3; all PRECISION 24, LOGIT_SHIFT 8)
    vocab, context_len, n_tokens: unsigned LEB128 varints
    token digest: 8 bytes, blake2b-64 of the tokens as little-endian int32
    crc32: 4 bytes little-endian, of the header bytes before it and of the body

A trie node's payload (:func:`encode_node`, :func:`decode_node`) is a tag byte
``NODE_TAG | version`` and the stream of :mod:`kvdb.codecs.rangecoder`, which ends on a byte: the node
row holds its count and context length, and its id checks the decode.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import struct
import warnings
import weakref
import zlib
from dataclasses import dataclass

import constriction
import numpy as np

from kvdb.codecs import rangecoder
from kvdb.errors import CorruptData, InvalidArgument

MAGIC = b"KL"
NODE_TAG = 0x80  # a node payload's first byte is NODE_TAG | version ("KL" payloads start with 0x4B)
# 1: the float model's one-token step; 3: kvdb.model.integer_lm's forward pass (portable); 2: that pass
# with torch.sqrt in its norms, which is not correctly rounded everywhere (read, no longer written)
VERSIONS = (1, 2, 3)
INTEGER_VERSIONS = (2, 3)
PORTABLE_VERSION = 3  # what new payloads get wherever kvdb.model.integer_lm covers the model
CHUNK = 256  # tokens a version-2/3 encoder runs through the forward pass at once
PRECISION = 24  # bits of the integer frequencies; constriction's Categorical codes at 24-bit precision
LOGIT_SHIFT = 8  # logits are rounded to multiples of 2**-8 nats before quantisation
WEIGHT_BITS = 32  # weight of the most probable symbol; with PRECISION 24 products stay below 2**56
_CRC = struct.Struct("<I")
DIGEST_BYTES = 8
_MAX_COUNT = 2**32 - 1

# round(2**62 * exp(-2**-LOGIT_SHIFT)), computed once with 60-digit decimal arithmetic. The weight
# table is built from it by an integer recurrence, so it does not depend on any platform's exp().
_DECAY_62 = 4593706758521714574


def _weight_table() -> np.ndarray:
    weights, w = [], 1 << WEIGHT_BITS
    while w:
        weights.append(w)
        w = (w * _DECAY_62) >> 62  # floor: strictly decreasing, so the table ends
    return np.asarray(weights, dtype=np.int64)


_WEIGHTS = _weight_table()  # 4,406 entries: a symbol ~17 nats below the top gets the floor only


def frequencies(logits, precision: int = PRECISION) -> np.ndarray:
    """Integer frequencies (int64, each >= 1, summing to ``2**precision``) from one row of logits.

    Deterministic: the same float32 logits give the same frequencies on any machine.
    Non-finite logits are treated as -inf (floor frequency only).
    """
    x = np.asarray(logits, dtype=np.float32).astype(np.float64)
    vocab = x.size
    budget = (1 << precision) - vocab
    if budget <= 0:
        raise InvalidArgument(f"vocabulary of {vocab} symbols does not fit {precision}-bit frequencies")
    q = np.rint(x * float(1 << LOGIT_SHIFT))
    finite = np.isfinite(q)
    if not finite.all():
        q[~finite] = -np.inf
    top = q.max()
    if not np.isfinite(top):  # nothing finite: uniform
        q[:] = 0.0
        top = 0.0
    distance = np.minimum(top - q, float(_WEIGHTS.size - 1)).astype(np.int64)
    w = _WEIGHTS[distance]
    w[distance == _WEIGHTS.size - 1] = 0
    freq = (w * budget) // int(w.sum()) + 1
    freq[int(np.argmax(w))] += (1 << precision) - int(freq.sum())
    return freq


@dataclass
class Context:
    """What coding the next token needs: the cache of every token so far and the next-token logits.

    Build one only with :func:`context_for`, :func:`encode_with_context` or :func:`decode` (or
    :meth:`empty`): they all run the same one-token steps, which is what makes the encoder's and the
    decoder's probabilities agree. A cache from a batched prefill holds slightly different floats
    and would not decode.
    """

    cache: object  # v1: a transformers DynamicCache holding `length` tokens; v2: an integer_lm.Cache
    logits: np.ndarray | None  # next-token logits after the last token; None when length == 0
    length: int
    version: int = 1  # the payload version whose forward pass built it

    @classmethod
    def empty(cls, model, version: int = 1) -> Context:
        if version in INTEGER_VERSIONS:
            return cls(_integer(model, version).new_cache(), None, 0, version)
        from kvdb.model.loading import new_cache

        return cls(new_cache(model), None, 0, 1)

    def copy(self) -> Context:
        return Context(
            copy.deepcopy(self.cache), None if self.logits is None else self.logits.copy(), self.length, self.version
        )


@dataclass(frozen=True)
class Header:
    version: int
    vocab: int
    context_len: int
    n_tokens: int
    digest: bytes
    size: int  # header bytes; the body follows


# -- the step both sides run ----------------------------------------------------------------


def vocab_size(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


@contextlib.contextmanager
def _pinned():
    """One intra-op thread while coding: the one-token step rounds differently with 1 and 2 threads
    (measured on SmolLM2: 7 of 300 rows of logits identical), so both sides fix it. Process-wide.

    torch is imported here and in the other functions that run the model, not by the module:
    reading a payload's header (``kvdb verify``) must not cost torch's import."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def _step(model, cache, token: int) -> np.ndarray:
    """One token through the model on top of ``cache`` (extended in place); its next-token logits.

    Call only under :func:`_pinned`.
    """
    import torch

    out = model(input_ids=torch.tensor([[token]], dtype=torch.long), cache=cache, use_cache=True)
    return out.logits[0, -1].float().numpy().copy()


def _entropy_model(logits: np.ndarray | None, vocab: int, precision: int):
    if logits is None:
        return constriction.stream.model.Uniform(vocab)
    if logits.shape != (vocab,):
        raise InvalidArgument(f"the model produced {logits.shape[-1]} logits per token, expected {vocab}")
    return constriction.stream.model.Categorical(frequencies(logits, precision).astype(np.float64), perfect=False)


def version_for(model) -> int:
    """The payload version new payloads of ``model`` get: 3 (portable) where kvdb.model.integer_lm
    covers the model, else 1, with a warning that its payloads decode only on machines that
    compute its forward pass alike."""
    from kvdb.model.integer_lm import IntegerLM

    reason = IntegerLM.unsupported(model)
    if reason is None:
        return PORTABLE_VERSION
    if id(model) not in _WARNED:
        _WARNED.add(id(model))
        warnings.warn(f"tier L falls back to payload version 1 (not portable across machines): {reason}", stacklevel=2)
    return 1


_WARNED: set[int] = set()
# model -> {version: its IntegerLM} (weights quantized once)
_INTEGER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _integer(model, version: int):
    from kvdb.model.integer_lm import IntegerLM

    passes = _INTEGER.setdefault(model, {})
    if PORTABLE_VERSION not in passes:
        passes[PORTABLE_VERSION] = IntegerLM(model)
    if version == 2 and 2 not in passes:
        passes[2] = passes[PORTABLE_VERSION].with_torch_sqrt()
    return passes[version]


def _start(model, context: Context | None, version: int | None) -> Context:
    """A copy of ``context`` to code on, or an empty one of ``version`` (default: ``version_for``)."""
    if context is not None:
        if version is not None and version != context.version:
            raise InvalidArgument(
                f"a version-{context.version} context cannot code a version-{version} payload; "
                f"build it with context_for(version={version})"
            )
        return context.copy()
    return Context.empty(model, version_for(model) if version is None else version)


def _advance(model, ctx: Context, ids: np.ndarray, each=None, feed_last: bool = True) -> None:
    """Feed ``ids`` to the context's forward pass, calling ``each(i, logits before ids[i])``
    first for every token: version 1 one token at a time, versions 2 and 3 in chunks (the same
    bits). Without ``feed_last`` version 1 skips its step on the last token (whose logits nobody
    reads when the context is thrown away); a chunk of versions 2 and 3 holds it anyway."""
    if ctx.version in INTEGER_VERSIONS:
        integer = _integer(model, ctx.version)
        for at in range(0, ids.size, CHUNK):
            chunk = ids[at : at + CHUNK]
            rows = integer.forward(chunk, ctx.cache).numpy()
            for j in range(chunk.size):
                if each is not None:
                    each(at + j, ctx.logits)
                ctx.logits = rows[j]
            ctx.length += chunk.size
            assert ctx.logits is not None  # the chunk holds a token
            ctx.logits = ctx.logits.copy()  # not a view keeping the chunk's rows alive
        return
    with _pinned():
        for i, token in enumerate(ids.tolist()):
            if each is not None:
                each(i, ctx.logits)
            if feed_last or i + 1 < ids.size:
                ctx.logits = _step(model, ctx.cache, token)
                ctx.length += 1


def context_for(model, ids, *, context: Context | None = None, version: int | None = None) -> Context:
    """The context after ``ids`` (following ``context`` if given, else of ``version``), by the
    same forward pass coding runs."""
    ids = _check_ids(ids, vocab_size(model))
    ctx = _start(model, context, version)
    _advance(model, ctx, ids)
    return ctx


# -- encode / decode ------------------------------------------------------------------------


def encode(model, ids, *, context: Context | None = None, version: int | None = None) -> bytes:
    """The payload of ``ids`` coded given ``context`` (default: no context, first token uniform;
    the payload version is the context's, else ``version``, else ``version_for(model)``).

    ``context`` is not modified.
    """
    return _encode(model, ids, context, version, keep_context=False)[0]


def encode_with_context(
    model, ids, *, context: Context | None = None, version: int | None = None
) -> tuple[bytes, Context]:
    """:func:`encode`, also returning the context after ``ids`` (to code a child trie node given it)."""
    return _encode(model, ids, context, version, keep_context=True)


def _encode(model, ids, context, version, keep_context: bool):
    vocab = vocab_size(model)
    encoder = constriction.stream.queue.RangeEncoder()
    ctx, context_len = _code(
        model,
        ids,
        context,
        version,
        keep_context,
        lambda logits, token: encoder.encode(token, _entropy_model(logits, vocab, PRECISION)),
    )
    body = encoder.get_compressed().astype("<u4").tobytes()
    ids = np.asarray(ids)
    head = MAGIC + bytes([ctx.version]) + _varint(vocab) + _varint(context_len) + _varint(ids.size) + _digest(ids)
    payload = head + _CRC.pack(zlib.crc32(body, zlib.crc32(head))) + body
    return payload, (ctx if keep_context else None)


def _code(model, ids, context, version, keep_context: bool, code_token) -> tuple[Context, int]:
    """Run ``ids`` through a copy of ``context`` calling ``code_token(logits before it, token)``
    for each; (the context after them, its length before)."""
    vocab = vocab_size(model)
    _check_vocab(vocab)
    ids = _check_ids(ids, vocab)
    if ids.size > _MAX_COUNT:
        raise InvalidArgument(f"{ids.size} tokens do not fit one payload (at most {_MAX_COUNT})")
    ctx = _start(model, context, version)
    context_len = ctx.length
    _advance(model, ctx, ids, lambda i, logits: code_token(logits, int(ids[i])), feed_last=keep_context)
    return ctx, context_len


def encode_node(model, ids, *, context: Context | None = None, version: int | None = None) -> tuple[bytes, Context]:
    """A trie node's payload of ``ids`` (one tag byte, then the exact coder's bytes,
    :mod:`kvdb.codecs.rangecoder`) and the context after them. It holds no count, context length,
    digest or CRC: the node row holds the first two, and its id, a hash of the path's tokens,
    checks a decode (:func:`decode_node`)."""
    vocab = vocab_size(model)
    encoder = rangecoder.Encoder()

    def code_token(logits, token: int) -> None:
        if logits is None:
            encoder.encode(token, 1, vocab)
        else:
            freq = frequencies(logits, PRECISION)
            encoder.encode(int(freq[:token].sum()), int(freq[token]), 1 << PRECISION)

    ctx, _ = _code(model, ids, context, version, True, code_token)
    return bytes([NODE_TAG | ctx.version]) + encoder.finish(), ctx


def is_node_payload(payload: bytes) -> bool:
    """A bare node payload (:func:`encode_node`), not a self-describing "KL" one."""
    return len(payload) >= 1 and payload[:2] != MAGIC


def payload_version(payload: bytes) -> int:
    """The version of either kind of payload; CorruptData when it is neither."""
    if not is_node_payload(payload):
        return read_header(payload).version
    tag = payload[0]
    if tag & 0x80 != NODE_TAG or tag & 0x7F not in VERSIONS:
        raise CorruptData(f"not a kvdb tier-L payload (first byte {tag:#04x}, {len(payload)} bytes)")
    return tag & 0x7F


def read_header(payload: bytes) -> Header:
    """The payload's header, after checking its CRC (covers header and body): CorruptData if it fails."""
    payload = bytes(payload)
    if len(payload) < 3 or payload[:2] != MAGIC:
        raise CorruptData("not a kvdb token-stream payload (bad magic or too short)")
    if payload[2] not in VERSIONS:
        raise CorruptData(
            f"token-stream payload version {payload[2]} is not one this kvdb reads "
            f"(it reads {', '.join(map(str, VERSIONS))})"
        )
    vocab, at = _read_varint(payload, 3)
    context_len, at = _read_varint(payload, at)
    n_tokens, at = _read_varint(payload, at)
    size = at + DIGEST_BYTES + _CRC.size
    if len(payload) < size:
        raise CorruptData("token-stream payload is truncated inside its header")
    digest = payload[at : at + DIGEST_BYTES]
    (crc,) = _CRC.unpack_from(payload, at + DIGEST_BYTES)
    body = memoryview(payload)[size:]
    if zlib.crc32(body, zlib.crc32(payload[: at + DIGEST_BYTES])) != crc:
        raise CorruptData("token-stream payload failed its CRC (truncated or damaged)")
    if len(body) % 4:
        raise CorruptData("token-stream payload body is not a whole number of 32-bit words")
    return Header(payload[2], vocab, context_len, n_tokens, digest, size)


def decode(model, payload: bytes, *, context: Context | None = None) -> tuple[np.ndarray, Context]:
    """The tokens of ``payload`` and the context after them; ``.cache`` holds context + decoded tokens.

    ``context`` must be the one the payload was encoded with (same length and tokens); it is not
    modified. Raises CorruptData when the payload is damaged or the decoded tokens fail the stored
    digest (wrong model or context, or a forward pass that computes differently from the encoder's).
    """
    header = read_header(payload)
    vocab = vocab_size(model)
    if header.vocab != vocab:
        raise InvalidArgument(f"payload was coded with a {header.vocab}-token vocabulary, the model has {vocab}")
    ctx = _start(model, context, header.version)
    if ctx.length != header.context_len:
        raise InvalidArgument(
            f"payload was coded after {header.context_len} context tokens, the context given holds {ctx.length}"
        )
    words = np.frombuffer(bytes(payload)[header.size :], dtype="<u4").astype(np.uint32)
    # Every symbol keeps a floor frequency, so no token costs less than -log2(1 - (V-1)/2**P) bits:
    # a header claiming more tokens than the body can hold is refused before the model runs.
    min_bits = -np.log2(1.0 - (vocab - 1) / float(1 << PRECISION))
    if header.n_tokens > 1 and (header.n_tokens - 1) * min_bits > 2 * (32 * words.size + 64):
        raise CorruptData(
            f"token-stream payload claims {header.n_tokens} tokens, more than its {4 * words.size}-byte body can hold"
        )
    decoder = constriction.stream.queue.RangeDecoder(words)
    out = _decode_tokens(
        model, header.n_tokens, ctx, lambda logits: int(decoder.decode(_entropy_model(logits, vocab, PRECISION)))
    )
    if _digest(out) != header.digest:
        raise CorruptData(
            "decoded tokens fail the payload's digest: the payload is damaged, or it was coded with another "
            "model or context, or this machine computes the model's forward pass differently from the encoder's"
        )
    return out, ctx


def decode_node(
    model, payload: bytes, n_tokens: int, *, context: Context | None = None, expect: np.ndarray | None = None
) -> tuple[np.ndarray, Context]:
    """The first ``n_tokens`` tokens of a node payload (:func:`encode_node`) and the context after
    them. ``n_tokens`` may be fewer than the node holds: a range coder decodes in order, so a read
    of a node's start costs a model step per token read, not per token stored. With ``expect``,
    decoding also stops after the first token that differs from it (only its tokens are compared:
    past them decoding goes on), which is all a prefix match needs. Nothing in the payload checks
    the tokens: the caller compares a whole node's with the node's id."""
    ctx = _start(model, context, payload_version(payload))
    vocab = vocab_size(model)
    decoder = rangecoder.Decoder(bytes(payload)[1:])

    def next_token(logits) -> int:
        if logits is None:
            return decoder.decode_uniform(vocab)
        return decoder.decode(np.concatenate([[0], np.cumsum(frequencies(logits, PRECISION))]))

    return _decode_tokens(model, n_tokens, ctx, next_token, expect), ctx


def _decode_tokens(model, n_tokens: int, ctx: Context, next_token, expect: np.ndarray | None = None) -> np.ndarray:
    """``n_tokens`` tokens, each ``next_token(the logits before it)``, advancing ``ctx`` (a copy of
    the caller's) through them; with ``expect``, only up to the first that differs from it."""
    expected = np.zeros(0, dtype=np.int64) if expect is None else np.asarray(expect)[:n_tokens]
    _check_vocab(vocab_size(model))
    out = np.empty(n_tokens, dtype=np.int64)
    try:
        with _pinned() if ctx.version == 1 else contextlib.nullcontext():  # pinned once, not once a token
            for i in range(n_tokens):  # the decoder learns each token only by decoding it: one step at a time
                out[i] = next_token(ctx.logits)
                _advance(model, ctx, out[i : i + 1])
                if i < len(expected) and out[i] != expected[i]:
                    return out[: i + 1]
    except (ValueError, RuntimeError, AssertionError) as exc:  # constriction reports exhausted/invalid data
        raise CorruptData(f"token-stream payload could not be decoded: {exc}") from exc
    return out


# -- helpers --------------------------------------------------------------------------------


def _digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes(), digest_size=8).digest()


def _check_ids(ids, vocab: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgument(f"token ids must be a 1-D integer array, got shape {arr.shape} and dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise InvalidArgument(f"token ids must lie in [0, {vocab}), got [{arr.min()}, {arr.max()}]")
    return arr


def _check_vocab(vocab: int) -> None:
    if vocab * 4 > 1 << PRECISION:  # the floor frequencies would take over a quarter of the probability mass
        raise InvalidArgument(f"a {vocab}-token vocabulary is too large for {PRECISION}-bit frequencies")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 35, 7):
        if at >= len(data):
            raise CorruptData("token-stream payload is truncated inside its header")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value > _MAX_COUNT:
                break
            return value, at
    raise CorruptData("token-stream payload header holds a malformed number")
