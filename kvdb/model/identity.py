"""Which model a session was computed with: its weights, its tokenizer, and the config that
decides what attention computes (sliding windows, layer types, RoPE, softcapping, head shapes).

The same weights under another attention config compute other keys and values, so they are
another model: another model id, other session ids, and a ``ModelMismatch`` where one is used
for the other's sessions. kvdb 0.1.0 hashed the weights and the tokenizer alone; its model rows
record no attention config. Such a row still names the model that opens it when what it did
record (model type, layer and head counts, sizes) agrees, so old archives keep their ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from kvdb.storage import Storage
from kvdb.storage.base import ModelRow

# Recorded in every model row since 0.1.0 (and compared against rows that record nothing else).
RECORDED = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
)
# What attention computes depends on these too, where a config has them.
ATTENTION = (
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "attention_chunk_size",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "rope_local_base_freq",
    "partial_rotary_factor",
    "rotary_pct",
    "rotary_emb_base",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "position_embedding_type",
)


def config_of(model_config) -> dict:
    """What a model row records of a transformers config: the 0.1.0 keys, and ``attention``."""
    recorded = {key: getattr(model_config, key, None) for key in RECORDED}
    # the vocabulary is the tokenizer's, hashed apart
    keys = [key for key in RECORDED if key != "vocab_size"] + list(ATTENTION)
    attention = {key: getattr(model_config, key) for key in keys if getattr(model_config, key, None) is not None}
    return dict(recorded, attention=json.loads(json.dumps(attention, sort_keys=True, default=str)))


def model_id(weights_hash: str, tokenizer_hash: str, config: dict) -> str:
    attention = json.dumps(config["attention"], sort_keys=True)
    return hashlib.sha256(f"{weights_hash}:{tokenizer_hash}:{attention}".encode()).hexdigest()[:32]


def legacy_model_id(weights_hash: str, tokenizer_hash: str) -> str:
    """The id kvdb 0.1.0 gave a model: weights and tokenizer only."""
    return hashlib.sha256(f"{weights_hash}:{tokenizer_hash}".encode()).hexdigest()[:32]


def in_archive(storage: Storage, identity: ModelRow) -> ModelRow:
    """The model's identity in this archive: its own, or the 0.1.0 row of the same weights and
    tokenizer when that row's recorded config agrees with this model's."""
    if storage.get_model(identity.model_id) is not None:
        return identity
    legacy = storage.get_model(legacy_model_id(identity.weights_hash, identity.tokenizer_hash))
    if legacy is None or "attention" in legacy.config:
        return identity
    if all(identity.config.get(key) == value for key, value in legacy.config.items()):
        return dataclasses.replace(identity, model_id=legacy.model_id)
    return identity
