"""Tier L: a node's tokens range-coded against the model's own next-token distribution, given
the context of its parent path (kvdb.model.lmcode; payload version 3, portable, where the model has
kvdb.model.integer_lm's forward pass). Decoding runs the model one token at a time, so this service
keeps what it can reuse: the context after the last session it coded (a conversation ingested
turn by turn resumes from it) and every token stream it decoded (content-addressed, so never
stale)."""

from __future__ import annotations

import numpy as np

from kvdb.errors import InvalidArgument
from kvdb.index import trie
from kvdb.model import lmcode
from kvdb.records import RestoredSession
from kvdb.services.models import ModelProvider
from kvdb.storage import Storage
from kvdb.storage.base import NodeRow, SessionRow, Split

RECENT_CACHE_TOKENS = 8192  # the last session's context is kept for reuse up to this length (~46 KB/token for SmolLM2)


class TierL:
    def __init__(self, storage: Storage, models: ModelProvider):
        self._storage = storage
        self._models = models
        self._recent: tuple[np.ndarray, lmcode.Context] | None = None  # (ids, context) after the last session coded
        # tokens decoded: a session's first ones by its id, a whole node's by (node id, start, length)
        self._decoded: dict = {}

    def encode(self, loaded, ids: np.ndarray, start: int, context=None) -> bytes:
        """Tier L of ids[start:] given the context of ids[:start] (the previous session's, when it
        ended exactly there, as a conversation ingested turn by turn does; else recomputed)."""
        context = context if context is not None else self.context(loaded, ids, start)
        payload, after = lmcode.encode_node(loaded.model, ids[start:], context=context)
        self._recent = (ids, after) if len(ids) <= RECENT_CACHE_TOKENS else None
        return payload

    def encode_nodes(self, loaded, ids: np.ndarray, nodes: list[NodeRow]) -> dict[str, bytes]:
        """Tier L of archived nodes of ``ids``'s path (root first) that were stored without it,
        each coded given its parent path's context: stepped on from the last node coded, through
        the nodes between that keep theirs, so the path is stepped through once."""
        payloads, context, at = {}, None, 0
        for node in nodes:
            if node.start > at:
                context = lmcode.context_for(loaded.model, ids[at : node.start], context=context)
            payloads[node.node_id], context = lmcode.encode_node(
                loaded.model, ids[node.start : node.end], context=context
            )
            at = node.end
        return payloads

    def context(self, loaded, ids: np.ndarray, length: int, version: int | None = None):
        """The context of ids[:length] for payloads of ``version`` (default: what new payloads get)."""
        if length == 0:
            return None
        version = lmcode.version_for(loaded.model) if version is None else version
        recent = self._recent
        if (
            recent is not None
            and recent[1].version == version
            and len(recent[0]) == length
            and np.array_equal(recent[0], ids[:length])
        ):
            return recent[1]
        return lmcode.context_for(loaded.model, ids[:length], version=version)

    def split(self, loaded, match: trie.PrefixMatch, ids: np.ndarray, head_id: str, tokens: np.ndarray | None):
        """(the Split of the node the new session diverges in, the tier-L context after its head).

        A node with tier L (its ``tokens`` given) gets both halves re-coded, since a range-coded
        stream cannot be cut; one held in tier L only brings its tokens and log-probabilities,
        which both halves hold from now on."""
        node = match.node
        assert node is not None  # a split is of the node the match ends in
        if "lm" not in node.keep:
            return Split(node.node_id, head_id, match.offset), None
        assert tokens is not None  # given for a node with tier L
        parent = self.context(loaded, ids, node.start)
        head, after_head = lmcode.encode_node(loaded.model, tokens[: match.offset], context=parent)
        tail, _ = lmcode.encode_node(loaded.model, tokens[match.offset :], context=after_head)
        if "tokens" in node.keep:
            return Split(node.node_id, head_id, match.offset, head, tail), after_head
        from kvdb.model import loading as lm_ops

        logprobs, _ = lm_ops.score(loaded.model, np.concatenate([ids[: node.start], tokens]), start=node.start)
        return Split(node.node_id, head_id, match.offset, head, tail, tokens, logprobs), after_head

    def node_tokens(self, node: NodeRow, before: np.ndarray, like: np.ndarray | None = None) -> np.ndarray:
        """A node's tokens: its blocks, or tier L decoded given ``before`` (its path's tokens).
        With ``like`` (a new stream's tokens from the node's start on), a decode stops at the
        first token that differs from them within the first ``trie.MIN_SPLIT``, or where they
        end before that: such a prefix match does not cut the node, whose thousands of tokens more
        would cost a model step each. A longer one cuts it, which needs all its tokens (and a
        resume decodes them all, as it did before, keeping them for the next prompt)."""
        if "tokens" in node.keep:
            return self._storage.node_tokens(node.node_id)
        key = (node.node_id, node.start, node.n_tokens)
        if key in self._decoded:
            return self._decoded[key]
        loaded = self._models.get()
        payload = self._lm_payload(node)
        context = self.context(loaded, before, len(before), lmcode.payload_version(payload))
        from kvdb.services import restore_modes as restore_ops

        end = node.n_tokens if like is None or len(like) >= trie.MIN_SPLIT else min(node.n_tokens, len(like))
        expect = None if like is None else like[: trie.MIN_SPLIT]
        ids, _ = restore_ops.decode_node(loaded, node, payload, before, context, end, expect)
        if len(ids) == node.n_tokens:  # only a whole node is kept, and checked against its id
            self._decoded[key] = ids
        return ids

    def _lm_payload(self, node: NodeRow) -> bytes:
        """The tier-L payload of a node that keeps one (any node whose token blocks are dropped does)."""
        payload = self._storage.node_lm_payload(node.node_id)
        assert payload is not None
        return payload

    def restore(self, row: SessionRow, nodes: list[NodeRow], at: int) -> RestoredSession:
        """Tokens and cache rebuilt from tier L along the path up to ``at``; a node without it (a
        prefix shared with a session archived without tier L) is read from its tokens instead."""
        from kvdb.services import restore_modes as restore_ops

        return restore_ops.restore_decode(
            self._models.for_session(row), row.session_id, self._parts(row, nodes, at), at
        )

    def session_tokens(self, row: SessionRow, path: list[NodeRow], end: int) -> np.ndarray:
        """A session's tokens [0, ``end``), decoding tier L where the path holds some only there:
        one model step per token, none past ``end``. The longest read is kept for the next."""
        have = self._decoded.get(row.session_id)
        if have is None or len(have) < end:
            from kvdb.services import restore_modes as restore_ops

            have, _ = restore_ops.decode_path(self._models.for_session(row), self._parts(row, path, end), end)
            self._decoded[row.session_id] = have
        return have[:end]

    def _parts(self, row: SessionRow, path: list[NodeRow], at: int) -> list[tuple[NodeRow, bytes | np.ndarray]]:
        """The nodes that hold tokens [0, ``at``), each with its tier-L payload or, without one, its
        tokens; read before the file is let go for the model's work."""
        nodes = [n for n in path if n.start < at]
        if not any("lm" in n.keep for n in nodes):
            raise InvalidArgument(
                f"session {row.session_id[:12]} ({row.name}) has no tier L on its first {at} tokens; "
                f"ingest it with --keep tokens,search,lm, or restore with --mode exact"
            )
        parts = [(n, self._lm_payload(n) if "lm" in n.keep else self._storage.node_tokens(n.node_id)) for n in nodes]
        self._storage.before_compute()
        return parts
