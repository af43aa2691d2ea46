"""Keeping an archive sound and small: deleting sessions, dropping tiers, checking and repairing
what is stored, freeing what nothing uses, and counting the bytes."""

from __future__ import annotations

from collections.abc import Iterable

from kvdb.errors import CorruptData, InvalidArgument
from kvdb.index.walk import Indexes, index_key
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import CodebookSet, Session, Stats
from kvdb.services import integrity as verify_ops
from kvdb.services import shipped_codebooks
from kvdb.services.models import ModelProvider
from kvdb.services.reading import Reader
from kvdb.services.tier_l import TierL
from kvdb.storage import Storage
from kvdb.storage.base import CollectGarbage, DeleteSession, DropTiers, ImportRows
from kvdb.tiers import TIERS, parse_keep


class Upkeep:
    def __init__(self, storage: Storage, models: ModelProvider, reader: Reader, tier_l: TierL, indexes: Indexes, prefix_cache: PrefixCache):
        self._storage = storage
        self._models = models
        self._reader = reader
        self._tier_l = tier_l
        self._indexes = indexes
        self._prefix_cache = prefix_cache

    def copy_to(self, target: Storage) -> dict:
        """Every row into ``target`` (an empty archive, of either backend) in one transaction,
        then each table's content hash compared on both sides. The search sidecars and the
        prefix cache are derived, and rebuilt there on first use."""
        from kvdb.storage import schema

        counts = target.apply(ImportRows({t.name: self._storage.table_rows(t.name) for t in schema.metadata.sorted_tables}))
        source, copied = self._storage.content_hashes(), target.content_hashes()
        differing = sorted(name for name in source if source[name] != copied[name])
        if differing:
            raise CorruptData(f"the copy in {target.describe()} differs from {self._storage.describe()} in {', '.join(differing)}; delete it and copy again")
        return {"source": self._storage.describe(), "target": target.describe(), "rows": counts, "sha256": source}

    def delete(self, ref: str) -> Session:
        row = self._reader.resolve(ref)
        self._storage.apply(DeleteSession(row.session_id))
        return Session.from_row(row)

    def compact(self, ref: str, keep: str | Iterable[str]) -> Session:
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
                            f"session {row.session_id[:12]} ({row.name}) has no tier L on tokens [{node.start}, {node.end}): "
                            "dropping the token tier would lose them; re-ingest it with --keep tokens,search,lm first"
                        )
        recoded = self._recode_for_tier_l_alone(row, [n for n in path if "tokens" in drops[n.node_id] and "tokens" in n.keep])
        restored = {}
        if "tokens" in keep and any("tokens" not in n.keep for n in path):
            from kvdb.model import (
                loading as lm_ops,  # scoring the decoded tokens runs the model
            )

            ids = self._reader.path_tokens(row)
            logprobs = lm_ops.score(self._models.for_session(row).model, ids)[0]
            restored = {n.node_id: (ids[n.start : n.end], logprobs[n.start : n.end]) for n in path if "tokens" not in n.keep}
        self._storage.apply(DropTiers(drops, restored, recoded))
        return Session.from_row(row)

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

    def verify(self, deep: bool = False) -> verify_ops.Report:
        """A search index behind or ahead of the database (a crash between writing the two) is
        what opening the index detects and rebuilds anyway; verify does that first and notes it."""
        before = len(self._indexes.rebuilt)
        for tok_hash in self._storage.tokenizer_hashes():
            self._indexes.get(index_key(tok_hash), tok_hash)
        notes = [f"search index {key} was missing or disagreed with the database; rebuilt" for key in self._indexes.rebuilt[before:]]
        indexes = {key: self._indexes.path(key) for key in self._storage.index_keys()}
        return verify_ops.verify(self._storage, indexes, deep, notes, self._prefix_cache.entries())

    def repair(self) -> dict:
        """Rebuild what can be derived (the search indexes; the prefix cache loses the entries
        it would never resume); report what cannot."""
        rebuilt = []
        for tok_hash in self._storage.tokenizer_hashes():
            self._indexes.rebuild(index_key(tok_hash), tok_hash)
            rebuilt.append(index_key(tok_hash))
        pruned = self._prefix_cache.prune(self._live_paths())
        remaining = self.verify(deep=True).problems
        return {"rebuilt_indexes": rebuilt, "pruned_prefix_cache_entries": pruned, "unrepairable": remaining, "ok": not remaining}

    def gc(self) -> dict:
        """Free the trie nodes (and every tier stored for them) that no session uses any more,
        and the prefix-cache entries of the conversations they held (a deleted session's KV
        must not outlive it on disk). A search index whose freed slots then outnumber its live
        ones is numbered anew, and the engine's small files are merged."""
        freed = self._storage.apply(CollectGarbage())
        assert freed is not None  # CollectGarbage returns what it freed
        freed["prefix_cache_entries"] = self._prefix_cache.prune(self._live_paths()) + self._prefix_cache.trim().entries
        freed["renumbered_indexes"] = [key for key, tok_hash in self._index_keys() if self._indexes.compact(key, tok_hash)]
        freed.update(self._storage.compact_files())
        return freed

    def _index_keys(self) -> list[tuple[str, str]]:
        indexed = set(self._storage.index_keys())
        return [(index_key(t), t) for t in self._storage.tokenizer_hashes() if index_key(t) in indexed]

    def _live_paths(self) -> dict[str, int]:
        """Node id -> the positions its path holds: what a prefix-cache entry must match."""
        return {n.node_id: n.end for n, _, _ in self._storage.node_shapes()}

    def stats(self) -> Stats:
        counts = self._storage.byte_counts()
        tiers = {
            "tokens": counts["token_bytes"],
            "lm": counts["lm_bytes"],
            "kv": counts["kv_bytes"],
            "logprobs": counts["logprob_bytes"],
            "metadata": counts["metadata_bytes"],
        }
        n = counts["tokens"]
        per_token = {k: (v / n if n else 0.0) for k, v in tiers.items()}
        # tier K is optional per node: its bytes are spread over the tokens stored with it
        per_token["kv"] = counts["kv_bytes"] / counts["kv_tokens"] if counts["kv_tokens"] else 0.0
        fp16 = self._fp16_bytes_per_token()
        ratio = fp16 / per_token["kv"] if per_token["kv"] and fp16 else None
        return Stats(
            counts["sessions"],
            n,
            counts["stored_tokens"],
            counts["nodes"],
            dict(tiers, file=self._storage.footprint(), codebooks=counts["codebook_bytes"], prefix_cache=self._prefix_cache.size()),
            per_token,
            ratio,
            counts["codebook_bytes"],
            sum(c.centroid_bytes for c in self.codebooks() if c.source == "shipped"),
        )

    def codebooks(self) -> list[CodebookSet]:
        return [shipped_codebooks.codebook_set(row) for row in self._storage.codebook_rows()]

    def _fp16_bytes_per_token(self) -> int | None:
        """K and V of one token in fp16 for the archive's first model: 2 x layers x kv heads x head dim x 2 B."""
        for row in self._storage.list_sessions()[:1]:
            model = self._storage.get_model(row.model_id)
            assert model is not None  # a session's model is stored with it
            c = model.config
            kv_heads = c.get("num_key_value_heads") or c.get("num_attention_heads")  # GPT-2, GPT-NeoX: one per query head
            if c.get("num_hidden_layers") and kv_heads:
                head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
                return 2 * c["num_hidden_layers"] * kv_heads * head_dim * 2
        return None
