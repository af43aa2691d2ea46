"""Putting an archived session back into the model, and continuing it.

Exact mode rebuilds the cache with one chunked prefill over the archived tokens: the same
computation ingest ran, so the restored cache gives the logits a fresh prefill gives.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from kvdb.codecs import fidelity as fidelity_ops
from kvdb.errors import CorruptData, InvalidArgument
from kvdb.index import trie
from kvdb.model import capture, chat, lmcode
from kvdb.model import loading as lm_ops
from kvdb.model import tokenizer as tok
from kvdb.model.loading import LoadedModel
from kvdb.records import CodebookSource, PresetFidelity, RestoredSession
from kvdb.storage.base import NodeRow
from kvdb.tiers import RestoreMode

if TYPE_CHECKING:
    from transformers import DynamicCache


def restore_exact(loaded: LoadedModel, session_id: str, prefix: np.ndarray) -> RestoredSession:
    """The cache of ``prefix`` (a session's first tokens), recomputed by one chunked prefill."""
    start = time.perf_counter()
    cache = lm_ops.prefill(loaded.model, prefix)
    return RestoredSession(
        session_id,
        loaded.model,
        loaded.tokenizer,
        cache,
        len(prefix),
        RestoreMode.EXACT,
        time.perf_counter() - start,
        prefix,
    )


def restore_archive(
    loaded: LoadedModel,
    session_id: str,
    prefix: np.ndarray,
    layers: Iterable[tuple[np.ndarray, np.ndarray]],
    started: float,
    window: str,
    exact_sinks: tuple[np.ndarray, np.ndarray] | None = None,
) -> RestoredSession:
    """The cache from de-quantized tier K (each layer's pre-RoPE keys and values), the attention
    sinks exact: given (``window="stored"``, no forward pass), or recomputed with the most recent
    positions (``"recompute"``; docs/decisions/0009-tier-k-exact-window.md, 0022 and 0024)."""
    cache = capture.restore_layers(loaded.model, prefix, layers, pre_rope=True, window=window, exact_sinks=exact_sinks)
    return RestoredSession(
        session_id,
        loaded.model,
        loaded.tokenizer,
        cache,
        len(prefix),
        RestoreMode.ARCHIVE,
        time.perf_counter() - started,
        prefix,
        window=window,
    )


def judged(measured: PresetFidelity, max_loss: float) -> tuple[bool, str]:
    """(whether ``auto`` may restore from tier K, the sentence that says why): only when its
    preset was measured, at every length measured, within ``max_loss`` (decision 0039)."""
    worst = fidelity_ops.worst_ppl(measured.lengths)
    if measured.source is CodebookSource.TRAINED:
        return (
            False,
            f"tier K was coded with codebooks trained on this archive ({measured.label}), "
            "whose fidelity nobody measured",
        )
    if worst is None:
        return False, f"tier K preset {measured.label} has no measured fidelity for this model"
    at, ratio = worst
    if ratio > max_loss:
        return (
            False,
            f"tier K preset {measured.label} is measured at ppl x{ratio:.2f} at {at:,} tokens, "
            f"above max-loss {max_loss:g}",
        )
    return (
        True,
        f"tier K preset {measured.label} is measured at ppl x{ratio:.2f} at worst ({at:,} tokens), "
        f"within max-loss {max_loss:g}",
    )


def measured_words(measured: PresetFidelity) -> str:
    """An explicit archive restore's account of its preset."""
    worst = fidelity_ops.worst_ppl(measured.lengths)
    if measured.source is CodebookSource.TRAINED:
        return f"tier K codebooks trained on this archive ({measured.label}), fidelity not measured"
    if worst is None:
        return f"tier K preset {measured.label}, fidelity not measured for this model"
    return f"tier K preset {measured.label}, measured at ppl x{worst[1]:.2f} at worst ({worst[0]:,} tokens)"


@torch.no_grad()
def fidelity(loaded: LoadedModel, archived_cache, exact_cache, probe: np.ndarray) -> dict:
    """Top-1 agreement and perplexity ratio of the archived cache against the exact one, over the
    session's own tokens ``probe`` (the first of which follows the restored prefix)."""
    logp_a, top_a = capture.teacher_forced(loaded.model, archived_cache, probe)
    logp_e, top_e = capture.teacher_forced(loaded.model, exact_cache, probe)
    return {
        "top1_agreement": round(float(np.mean(top_a == top_e)), 4),
        "ppl_ratio": round(float(np.exp(np.mean(logp_e) - np.mean(logp_a))), 4),
        "probe_tokens": int(len(probe)),
    }


def decode_node(
    loaded: LoadedModel,
    node: NodeRow,
    payload: bytes,
    before: np.ndarray,
    context,
    end: int | None = None,
    expect: np.ndarray | None = None,
) -> tuple[np.ndarray, lmcode.Context]:
    """A node's tokens [0, ``end``) (default: all of them) from its tier-L payload, given ``before``
    (its path's tokens) and their ``context``; with ``expect``, only up to the first token that
    differs from it (see ``lmcode.decode_node``). A node decoded whole is checked against the
    node's id, which hashes the path's tokens; a part of one cannot be, since the id covers them
    all. A self-describing "KL" payload (what kvdb wrote before node payloads) is decoded whole,
    against its digest."""
    if len(before) != node.start:
        raise InvalidArgument(
            f"node {node.node_id[:12]} starts at token {node.start}; {len(before)} tokens were given before it"
        )
    end = node.n_tokens if end is None else end
    if not lmcode.is_node_payload(payload):
        ids, after = lmcode.decode(loaded.model, payload, context=context)
        return ids[:end], after
    ids, after = lmcode.decode_node(loaded.model, payload, end, context=context, expect=expect)
    if (
        len(ids) == node.n_tokens
        and trie.path_id(loaded.identity.model_id, np.concatenate([before, ids])) != node.node_id
    ):
        raise CorruptData(
            f"tier L payload of node {node.node_id[:12]} decodes to tokens its id does not hash: "
            "the payload is damaged, "
            "or this machine computes the model's forward pass differently from the encoder's"
        )
    return ids, after


def decode_path(
    loaded: LoadedModel, parts: list[tuple[NodeRow, bytes | np.ndarray]], at: int
) -> tuple[np.ndarray, lmcode.Context | None]:
    """Tokens [0, ``at``) of a path's nodes, root first, each with its tier-L payload or its
    tokens, and the context after them. A payload is decoded given the context its parent left
    (of the payload's version: where the version changes along the path, that context is built
    again from the tokens so far), and only as far as ``at``, since a token costs a model step; a
    node given as tokens (one without tier L) is fed through the same forward pass, so the
    contexts are the ones the encoder saw."""
    context: lmcode.Context | None = None
    pieces: list[np.ndarray] = []
    for node, part in parts:
        if node.start >= at:
            break
        end = min(node.n_tokens, at - node.start)
        if isinstance(part, np.ndarray):
            ids, context = part[:end], lmcode.context_for(loaded.model, part[:end], context=context)
        else:
            version = lmcode.payload_version(part)
            before = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
            if context is not None and context.version != version:
                context = lmcode.context_for(loaded.model, before, version=version)
            ids, context = decode_node(loaded, node, part, before, context, end)
        pieces.append(ids)
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)), context


def restore_decode(
    loaded: LoadedModel, session_id: str, parts: list[tuple[NodeRow, bytes | np.ndarray]], at: int
) -> RestoredSession:
    """The cache of tokens [0, ``at``) rebuilt from tier L along a path (``decode_path``): version
    1's own context, which is the model's cache; after versions 2 and 3 (an integer forward pass,
    not the model's), one prefill of the tokens."""
    start = time.perf_counter()
    tokens, context = decode_path(loaded, parts, at)
    if context is not None and context.version == 1:
        cache = cast("DynamicCache", context.cache)
        extra = cache.get_seq_length() - at  # only after a "KL" payload, which decodes whole
        if extra:
            cache.crop(-extra)
    else:
        cache = lm_ops.prefill(loaded.model, tokens)
    return RestoredSession(
        session_id, loaded.model, loaded.tokenizer, cache, at, RestoreMode.DECODE, time.perf_counter() - start, tokens
    )


def continuation_ids(loaded: LoadedModel, prompt: str | None, as_turn: bool, before: np.ndarray) -> np.ndarray:
    """The tokens a prompt adds: a new user turn for chat sessions (``as_turn``), the text itself
    otherwise. A chat restored after a finished turn with no prompt gets the assistant's header,
    so the model replies again rather than opening a turn of its own choosing (a "tool" turn)."""
    if not prompt:
        if as_turn and chat.ends_turn(loaded.tokenizer, before):
            return np.asarray(tok.encode(loaded.tokenizer, chat.turns_suffix(loaded.tokenizer, [])), dtype=np.int64)
        return np.zeros(0, dtype=np.int64)
    text = chat.user_turn_suffix(loaded.tokenizer, prompt) if as_turn else prompt
    return np.asarray(tok.encode(loaded.tokenizer, text), dtype=np.int64)


def continue_restored(
    loaded: LoadedModel, restored: RestoredSession, prompt_ids: np.ndarray, max_new_tokens: int
) -> str:
    """Greedy continuation after the restored tokens (and the prompt, if any)."""
    if max_new_tokens < 1:
        raise InvalidArgument(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = np.concatenate([restored.tokens, prompt_ids])
    if len(ids) == 0:
        raise InvalidArgument("nothing to continue from: restore at a position > 0 or give a prompt")
    if len(prompt_ids) == 0:
        # generate() needs one token it has not seen; hand it the last restored one again.
        restored.cache.crop(-1)
    try:
        new = lm_ops.generate(loaded.model, loaded.tokenizer, restored.cache, ids, max_new_tokens)
    finally:  # back to the restored positions: a second call continues from the same state
        extra = restored.cache.get_seq_length() - restored.position
        if extra:
            restored.cache.crop(-extra)
    return cast(str, loaded.tokenizer.decode(new, skip_special_tokens=True))  # one sequence: one string
