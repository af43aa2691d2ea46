"""Changing what is stored of a session: deleting it, and dropping tiers from its path."""

from __future__ import annotations

from collections.abc import Iterable

from kvdb.errors import InvalidArgument
from kvdb.records import Compacted, Deleted
from kvdb.services.forgetting import Forgetting
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.services.tier_l import TierL
from kvdb.storage import Storage
from kvdb.storage.base import DeleteSession, DropTiers
from kvdb.tiers import TIERS, Tier, parse_keep


class Editor:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, tier_l: TierL):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._tier_l = tier_l

    def delete(self, ref: str) -> Deleted:
        row = self._reader.resolve(ref)
        self._storage.apply(DeleteSession(row.session_id))
        Forgetting(self._storage).deleted([row])  # what gc then erases, and watch's tombstone
        return Deleted.from_row(row)

    def compact(self, ref: str, keep: str | Iterable[str]) -> Compacted:
        """Drop the tiers not in ``keep`` from every node of the session's path (shared prefix
        nodes included: they are one stored object for all the sessions that share them).

        The token tier is the exception: only the nodes no other session uses drop it, and only
        where tier L holds their tokens, since every session sharing a node reads and matches
        through its tokens. Keeping ``tokens`` on a session held in tier L decodes them back.
        A node left with tier L alone whose payload is not what this kvdb writes for the model
        (version 1 or 2, or a "KL" framed one, from before version 3) is re-coded from its tokens
        first: version 3 decodes on any machine, the others only where they were written.
        """
        keep = parse_keep(keep)
        row = self._reader.resolve(ref)
        path = self._storage.node_path(row.session_id)
        drops = {n.node_id: set(TIERS) - keep - {"tokens"} for n in path}
        if "tokens" not in keep:
            for node in path:
                if node.refcount == 1:
                    drops[node.node_id].add("tokens")
                    if "lm" not in node.keep:
                        raise InvalidArgument(
                            f"session {row.session_id[:12]} ({row.name}) has no tier L "
                            f"on tokens [{node.start}, {node.end}): "
                            "dropping the token tier would lose them; re-ingest it with --keep tokens,search,lm first"
                        )
        recoded = self._recode_for_tier_l_alone(
            row, [n for n in path if "tokens" in drops[n.node_id] and "tokens" in n.keep]
        )
        restored = {}
        if "tokens" in keep and any("tokens" not in n.keep for n in path):
            from kvdb.model import (
                loading as lm_ops,  # scoring the decoded tokens runs the model
            )

            ids = self._reader.path_tokens(row)
            logprobs = lm_ops.score(self._models.for_session(row).model, ids)[0]
            restored = {
                n.node_id: (ids[n.start : n.end], logprobs[n.start : n.end]) for n in path if "tokens" not in n.keep
            }
        self._storage.apply(DropTiers(drops, restored, recoded))
        return Compacted.from_row(row, keep=tuple(t for t in Tier if t in keep))

    def _recode_for_tier_l_alone(self, row, nodes) -> dict[str, bytes]:
        """New payloads for ``nodes`` (about to keep tier L alone) whose stored one is not the
        node payload new ingests write for the model; each coded given its path's context. The
        model loads only when some payload is not the portable version's already."""
        from kvdb.model import lmcode

        payloads = {n.node_id: self._storage.node_lm_payload(n.node_id) for n in nodes}

        def current(node, version: int) -> bool:
            payload = payloads[node.node_id]
            assert payload is not None  # only nodes that keep tier L lose their token blocks
            return lmcode.is_node_payload(payload) and lmcode.payload_version(payload) == version

        stale = [n for n in nodes if not current(n, lmcode.PORTABLE_VERSION)]
        if not stale:
            return {}
        loaded = self._models.for_session(row)
        version = lmcode.version_for(loaded.model)
        stale = [n for n in stale if not current(n, version)]
        if not stale:
            return {}
        ids = self._reader.path_tokens(row)
        self._storage.before_compute()  # the model's work reads nothing from the file
        return self._tier_l.encode_nodes(loaded, ids, stale)
