"""What tests share besides fixtures: a tiny model to build, transcript writers, and the one
place a test looks at what is stored beneath the public API."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "transcripts"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_model(folder: Path, seed: int = 0, arch: str = "Llama", **config) -> Path:
    """A 2-layer causal LM of transformers' ``{arch}Config`` (Llama by default; ``config``
    overrides, e.g. ``sliding_window``) over a byte-level tokenizer (256 bytes + 3 specials):
    any unicode round-trips."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        bos_token_id=vocab["<|im_start|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|im_end|>"],
    )
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, f"{arch}Config")(**shape | config))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CALIBRATION = (
    "Residual vector quantization stores each key and value as a few codebook indices. "
    "The archive keeps them per trie node, and a restore rebuilds the cache without a forward pass. "
) * 4
KV = "tokens,search,kv"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    return path


def write_jsonl(path: Path, rows) -> Path:
    return write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def storage_of(archive):
    """The archive's storage backend: tests that check the stored trie itself (which nodes hold
    which tiers, how often the file was opened) read it here; the public API does not show nodes."""
    return archive._storage


# keys under which a transcript of any format holds conversation text (not ids, types or data)
TEXT_KEYS = {
    "content",
    "text",
    "value",
    "thinking",
    "arguments",
    "output",
    "instruction",
    "input",
    "system",
    "instructions",
    "parts",
    "message",
    "mes",
}


def conversation_texts(value, key=None):
    """Every non-empty string a parsed transcript file holds under one of TEXT_KEYS: what must
    come back from `show` for nothing to have been dropped."""
    if isinstance(value, str):
        if key in TEXT_KEYS and value:
            yield value
    elif isinstance(value, list):
        for item in value:
            yield from conversation_texts(item, key)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from conversation_texts(v, k)


# Float premises --------------------------------------------------------------------------
# Some golden values follow from float results that differ by CPU. A test of such a value
# checks it only where this machine computes its inputs as the machine that wrote it did,
# and says so when it does not (the portable formats are checked everywhere).

# sqrt_probe()'s fingerprint on the machine where tier-L version 2's golden values were made (an
# AMD EPYC: a vector math library that is off by one ulp in about 1% of float64 roots).
SQRT_PROBE_AS_GOLDEN = "8b5c34d0812d88917d9ce60ff10c12c1d825b700613aed970eed7161dcd23c9c"


def sqrt_probe() -> tuple[str, bool]:
    """(sha256 of torch.sqrt over 100,000 float64 values shaped like a norm's mean squares,
    whether every one of them is the correctly rounded root)."""
    x = torch.from_numpy(np.random.default_rng(0).uniform(1e-5, 100.0, (100_000, 1)))
    roots = torch.sqrt(x)
    return hashlib.sha256(roots.numpy().astype("<f8").tobytes()).hexdigest(), bool(
        np.array_equal(roots.numpy(), np.sqrt(x.numpy()))
    )


def examples(full: int) -> int:
    """A property's example count: ``full`` under ``KVDB_TESTS=thorough``, a fifth of it (at least
    10) by default, so make test stays short on 2 cores while every property still runs."""
    return full if os.environ.get("KVDB_TESTS") == "thorough" else max(10, full // 5)


def undo_child_keys(conn) -> None:
    """Take an archive's nodes back to before migration 0014 (no ``child_key``; a file's index on
    parent and first token again), on its own connection: a lake has no indexes."""
    indexed = conn.execute("select count(*) from duckdb_indexes() where index_name = 'ix_nodes_child_key'").fetchone()[
        0
    ]
    if indexed:
        conn.execute("drop index ix_nodes_child_key")
    conn.execute("alter table nodes drop column child_key")  # DuckDB alters no table an index depends on
    if indexed:
        conn.execute("create index ix_nodes_children on nodes (parent_id, first_token)")


def stream(seed: int, alphabet: int, length: int) -> np.ndarray:
    """Uniform symbols, with the extreme values forced in so that edge digits are exercised."""
    symbols = np.random.default_rng(seed).integers(0, alphabet, length)
    if length:
        symbols[np.random.default_rng(seed + 1).integers(0, length, 2)] = [0, alphabet - 1]
    return symbols


def clustered_vectors(layers=2, heads=2, n=600, dim=8, seed=0):
    """Keys or values for the KV tier's codebooks: ``[layers, heads, n, dim]``."""
    rng = np.random.default_rng(seed)
    # anisotropic, clustered data, a little like real K/V; the same clusters for every seed
    centres = np.random.default_rng(99).standard_normal((layers, heads, 5, dim)) * 3
    pick = rng.integers(0, 5, size=(layers, heads, n))
    base = np.take_along_axis(centres, pick[..., None].repeat(dim, -1), axis=2)
    scale = np.linspace(2.0, 0.2, dim)
    return (base + rng.standard_normal((layers, heads, n, dim)) * scale).astype(np.float32)


def trained_codebooks():
    """Residual VQ codebooks ``k3x16v2x16`` of two layers, and the keys and values they were trained on."""
    from kvdb.codecs import quant

    k, v = clustered_vectors(seed=1), clustered_vectors(seed=2)
    return quant.train({"k": k, "v": v}, "k3x16v2x16", niter=8), k, v


SMAPS = Path("/proc/self/smaps")  # Linux's: what each mapping of this process holds resident


def resident_kib(paths) -> int:
    """How much of these files this process has resident through its mappings of them (``SMAPS``)."""
    names, total, mapped = {str(p) for p in paths}, 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            mapped = len(fields) > 5 and fields[5] in names
        elif mapped and fields[0] == "Rss:":
            total += int(fields[1])
    return total
