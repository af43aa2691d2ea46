"""Loading a causal LM (the embedded default or any Hugging Face id/folder; where it comes from
is :mod:`kvdb.model.source`), its identity, and the two forward passes kvdb needs: scoring a
token stream at ingest and prefilling a cache at restore.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvdb.errors import UnsupportedModel
from kvdb.model import description, identity
from kvdb.model import tokenizer as tok
from kvdb.model.source import causal_lm, model_folder, model_name
from kvdb.storage.base import ModelRow
from kvdb.user_cache import read_cached, stamp_key, write_cached

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHUNK = 512  # tokens per forward pass: bounds the logits tensor (CHUNK x vocab floats)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    identity: ModelRow  # what the archive records about it

    @property
    def context_tokens(self) -> int:
        return description.context_tokens(self.model.config)

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.model.config, "vocab_size"))  # noqa: B009 (torch types config as a Module)


def load(name: str | None = None) -> LoadedModel:
    """The model with transformers' tokenizer (it renders chat templates, which ingest and
    generation need); its facts are cached for ``description.describe``."""
    name = model_name(name)
    folder = model_folder(name)
    tokenizer = tok.load_full(name)
    model = causal_lm(name, folder)
    _check_cache_layout(name, model)
    loaded = LoadedModel(
        model, tokenizer, _identity(name, model, tokenizer, Path(folder) if Path(folder).is_dir() else None)
    )
    description.remember(name, loaded.identity, model.config)
    return loaded


@torch.no_grad()
def _check_cache_layout(name: str, model) -> None:
    """Refuse, before anything is written, a model whose attention state is not one K/V pair per
    layer and position (recurrent or state-space layers): kvdb archives, slices and restores those."""
    layers = model.config.num_hidden_layers
    kinds = sorted(
        set(getattr(model.config, "layer_types", None) or [])
        - {"full_attention", "sliding_attention", "chunked_attention"}
    )
    if kinds:
        raise UnsupportedModel(
            f"model {name!r} has {', '.join(kinds)} layers, whose state is not a per-position K/V cache; "
            "kvdb cannot archive it"
        )
    cache = new_cache(model)
    try:
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, use_cache=True)
        held = [layer.keys.shape[-2] for layer in cache.layers if getattr(layer, "keys", None) is not None]
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise UnsupportedModel(
            f"model {name!r} does not run on a per-layer K/V cache ({type(exc).__name__}: {exc}); "
            "kvdb cannot archive it"
        ) from exc
    if held != [2] * layers:
        raise UnsupportedModel(
            f"model {name!r} keeps K/V for {len(held)} of its {layers} layers on a plain cache; "
            "kvdb archives one K/V pair per layer and position"
        )


def _identity(name: str, model, tokenizer, folder: Path | None) -> ModelRow:
    weights = _cached_weights_hash(model, folder)
    tok_hash = tok.fingerprint(tokenizer)
    config = identity.config_of(model.config)
    return ModelRow(identity.model_id(weights, tok_hash, config), name, weights, tok_hash, config)


def _cached_weights_hash(model, folder: Path | None) -> str:
    """Hashing every weight costs a pass over them; for a folder it is cached by the files' sizes and mtimes."""
    if folder is None:
        return weights_hash(model)
    key = stamp_key(folder)
    digest = read_cached("weights-hashes", key)
    if digest is None:
        digest = weights_hash(model)
        write_cached("weights-hashes", key, digest)
    return digest


def weights_hash(model) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), independent of file format."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{key}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# forward passes ---------------------------------------------------------------------------


def score(model, ids: np.ndarray, start: int = 0, cache=None, chunk: int = CHUNK):
    """(ln p(ids[i] | ids[:i]) for i in [start, n) as float32, a cache holding all of ``ids``).

    ``cache``, when given, must hold ``ids[:start - 1]`` (a shared prefix computed before);
    without it that prefix is prefilled here. The first token has no context; it gets the
    uniform prior ``-ln(vocab)``, the cost any coder without context pays, so sums over a
    token path stay meaningful.
    """
    logprobs, cache, _ = score_and_next(model, ids, start, cache, chunk)
    return logprobs, cache


@torch.no_grad()
def score_and_next(model, ids: np.ndarray, start: int = 0, cache=None, chunk: int = CHUNK):
    """``score``, and the logits that follow ``ids`` (what a generation picks its first token
    from): a prompt scored and prefilled in one pass."""
    batch = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    n = batch.shape[1]
    out = np.empty(max(n - start, 0), dtype=np.float32)
    if start == 0 and n:
        out[0] = -math.log(model.config.vocab_size)
    fed = max(start - 1, 0)
    cache = prefill(model, batch[0, :fed].numpy(), chunk) if cache is None else cache
    if cache.get_seq_length() != fed:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, expected {fed}")
    logits = None
    for a in range(fed, n, chunk):
        b = min(a + chunk, n)
        logits = model(batch[:, a:b], cache=cache, use_cache=True).logits[0].float()
        lo, hi = max(a + 1, start), min(b + 1, n)  # logits of position j predict token j + 1
        if hi > lo:
            logp = torch.log_softmax(logits[lo - 1 - a : hi - 1 - a], dim=-1)
            out[lo - start : hi - start] = logp.gather(1, batch[0, lo:hi, None])[:, 0].numpy()
    return out, cache, None if logits is None else logits[-1]


@torch.no_grad()
def prefill(model, ids: np.ndarray, chunk: int = CHUNK, cache=None):
    """A DynamicCache holding ``ids`` exactly as one fresh forward pass would compute it; given a
    ``cache`` holding a prefix of ``ids``, only the rest is computed, onto it."""
    batch = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    cache = new_cache(model) if cache is None else cache
    for start in range(cache.get_seq_length(), batch.shape[1], chunk):
        model(batch[:, start : start + chunk], cache=cache, use_cache=True)
    return cache


def new_cache(model):
    """An empty cache whose every layer keeps all positions [0, n).

    ``DynamicCache(config=...)`` gives sliding-window layers (Mistral, Gemma2/3) a cache of the
    last window only, which kvdb would save, slice by absolute position and crop as if it were
    whole. A full-length cache gives the same logits (the model's own masks apply the window:
    measured identical on tiny Mistral and Gemma2) and can be captured, saved and cropped.
    """
    from transformers import DynamicCache

    return DynamicCache()


@torch.no_grad()
def generate(model, tokenizer, cache, ids: np.ndarray, max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``ids``, whose first ``cache.get_seq_length()`` tokens are in ``cache``."""
    input_ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    eos = tokenizer.eos_token_id
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        cache=cache,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=eos,
    )
    return output[0, input_ids.shape[1] :].tolist()
