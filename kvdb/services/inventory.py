"""What an archive holds: its sessions, tokens and bytes per tier, and its codebooks."""

from __future__ import annotations

from kvdb.codecs import presets
from kvdb.model.prefix_cache import PrefixCache
from kvdb.records import CodebookSet, CodebookSource, Pending, Stats
from kvdb.services import shipped_codebooks
from kvdb.storage import Storage


class Inventory:
    def __init__(self, storage: Storage, prefix_cache: PrefixCache):
        self._storage = storage
        self._prefix_cache = prefix_cache

    def stats(self) -> Stats:
        counts = self._storage.byte_counts()
        tiers = {
            "tokens": counts["token_bytes"],
            "lm": counts["lm_bytes"],
            "kv": counts["kv_bytes"],
            "semantic": counts["semantic_bytes"],
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
            dict(
                tiers,
                file=self._storage.footprint(),
                codebooks=counts["codebook_bytes"],
                prefix_cache=self._prefix_cache.size(),
            ),
            per_token,
            ratio,
            counts["codebook_bytes"],
            sum(c.centroid_bytes for c in self.codebooks() if c.source is CodebookSource.SHIPPED),
            self._kv_bytes_by_preset(),
            Pending.from_counts(self._storage.pending_counts()),
        )

    def _kv_bytes_by_preset(self) -> dict[str, int]:
        """Tier K code bytes per preset: its name with its model where it has one, else its spec
        (a trained set and the shipped one of a spec count together: they cost the same)."""
        stored = self._storage.kv_bytes_by_codebooks()
        out: dict[str, int] = {}
        for row in self._storage.codebook_rows():
            if row.codebook_id in stored:
                model = self._storage.get_model(row.model_id)
                label = (presets.name_of(row.preset, model.weights_hash) if model is not None else None) or row.preset
                out[label] = out.get(label, 0) + stored[row.codebook_id]
        return out

    def codebooks(self) -> list[CodebookSet]:
        return [shipped_codebooks.codebook_set(row) for row in self._storage.codebook_rows()]

    def _fp16_bytes_per_token(self) -> int | None:
        """K and V of one token in fp16 for the archive's first model: 2 x layers x kv heads x head dim x 2 B."""
        model_id = self._storage.first_model_id()
        if model_id is not None:
            model = self._storage.get_model(model_id)
            assert model is not None  # a session's model is stored with it
            c = model.config
            # GPT-2, GPT-NeoX: one per query head
            kv_heads = c.get("num_key_value_heads") or c.get("num_attention_heads")
            if c.get("num_hidden_layers") and kv_heads:
                head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
                return 2 * c["num_hidden_layers"] * kv_heads * head_dim * 2
        return None
