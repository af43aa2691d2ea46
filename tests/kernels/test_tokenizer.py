"""kvdb.model.tokenizer: the light tokenizer (``tokenizers`` alone) must be transformers' tokenizer for
every purpose the read-only commands have: the same fingerprint (archives store it as
``tokenizer_hash``), the same ids for a text and the same text for ids; and loading it must
import neither torch nor transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvdb.model import chat
from kvdb.model import loading as lm_ops
from kvdb.model import tokenizer as tok
from kvdb.model.tokenizer import LightTokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

TEXTS = [
    "",
    " ",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs, newlines\n\n\nand\r\nCRLF\r\n",
    " " * 17 + "x" + "\n" * 9 + "\t " * 5,
    "naïve café, Größe, ﬁligree, e\u0301 (combining), Ångström",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "العربية עברית Ελληνικά русский",
    "emoji 😀🎉 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 and flags 🇫🇷🇯🇵",
    "\u200b zero-width \ufeff bom \u00a0 nbsp \u2028 line sep",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n",
    "<|endoftext|><|im_start|><|im_end|>",
    "glued<|im_start|>special<|im_end|>tokens",
    "<|im_start |> <|im_start| not special <im_start>",
    "code: def f(x):\n    return x ** 2  # comment\n\n\n\tif __name__ == '__main__':",
    "numbers 3.14159 1,000,000 0x1F 2024-06-01T12:00:00Z",
    "\x00\x01\x7f control",
]


def long_text() -> str:
    parts = [p.read_text(encoding="utf-8") for p in sorted((REPO / "examples" / "transcripts").iterdir())]
    return ("\n\n".join(parts + TEXTS) + " 🧪 ") * 8


def assert_same(light, full) -> None:
    assert isinstance(light, LightTokenizer)
    assert not isinstance(full, LightTokenizer)
    assert tok.fingerprint(light) == tok.fingerprint(full)
    assert light.chat_template == full.chat_template
    for text in [*TEXTS, long_text()]:
        ids = tok.encode(light, text)
        assert ids == tok.encode(full, text), text
        assert tok.decode(light, ids) == tok.decode(full, ids), text
    rng = np.random.default_rng(0)
    vocab = full.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    for n in (1, 2, 7, 300):  # arbitrary ids: partial UTF-8 byte runs, specials anywhere
        ids = rng.integers(0, vocab, n)
        assert tok.decode(light, ids) == tok.decode(full, ids)


def tokenizer_copy(folder: str | Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(Path(folder) / name, dest / name)
    return dest


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def imports_after_load(name: str | None) -> dict:
    """In a fresh interpreter: load, fingerprint, encode, decode; which heavy modules got imported."""
    code = (
        "import json, sys\n"
        "from kvdb.model import tokenizer as tok\n"
        f"t = tok.load({name!r})\n"
        "ids = tok.encode(t, 'hello <|im_start|> wörld 😀')\n"
        "out = {'light': type(t).__name__, 'fingerprint': tok.fingerprint(t), 'ids': ids, 'text': tok.decode(t, ids),\n"
        "       'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache dir of the test's own: no cached fingerprint to begin with (not for the embedded model)."""
    monkeypatch.setenv("KVDB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tiny_light_is_transformers(tiny_model, private_cache):
    full = tok.load_full(tiny_model)
    assert_same(tok.load(tiny_model), full)


@pytest.mark.parametrize("piece_chars", [1, 7, 64, 1 << 30])
def test_a_long_text_is_encoded_in_pieces_as_it_is_whole(tiny_model, private_cache, monkeypatch, piece_chars):
    """Cut where a special token begins, a text's pieces give the ids the whole gives (1 << 30:
    no cut), with either tokenizer; texts with specials glued to words, at the start and end."""
    light, full = tok.load(tiny_model), tok.load_full(tiny_model)
    whole = {text: full(text, add_special_tokens=False)["input_ids"] for text in [*TEXTS, long_text()]}
    monkeypatch.setattr(tok, "PIECE_CHARS", piece_chars)
    for text, ids in whole.items():
        assert tok.encode(light, text) == ids == tok.encode(full, text), text
    assert len(tok._pieces(light, long_text())) > (1 if piece_chars < 1 << 30 else 0)


class CountingBackend:
    """A tokenizers backend that records the texts it is given to encode."""

    def __init__(self, backend):
        self.backend, self.encoded = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def encode_batch(self, texts, **kwargs):
        self.encoded += texts
        return self.backend.encode_batch(texts, **kwargs)

    def encode(self, text, **kwargs):
        self.encoded.append(text)
        return self.backend.encode(text, **kwargs)


def test_a_text_that_grows_encodes_only_its_last_piece_again(tiny_model, private_cache, monkeypatch):
    """A growing log is rendered again whole at each turn: its pieces but the last are remembered,
    and the ids are still those of the whole text."""
    light, full = tok.load(tiny_model), tok.load_full(tiny_model)
    counting = dataclasses.replace(light, backend=CountingBackend(light.backend))
    monkeypatch.setattr(tok, "PIECE_CHARS", 4096)
    turn = (
        "<|im_start|>user\nAnd the harbour ledger? 😀<|im_end|>\n"
        "<|im_start|>assistant\nIn the keeper's lamp room.<|im_end|>\n"
    )
    text = long_text()
    first = tok._pieces(light, text)
    assert tok.encode(counting, text) == full(text, add_special_tokens=False)["input_ids"] and len(first) > 3
    counting.backend.encoded.clear()
    grown = text + turn
    assert tok.encode(counting, grown) == full(grown, add_special_tokens=False)["input_ids"]
    assert counting.backend.encoded == [tok._pieces(light, grown)[-1]]  # the last piece, grown: no other again
    monkeypatch.setattr(tok._KNOWN, "size", 1)
    assert (
        tok.encode(counting, "x" + grown) == full("x" + grown, add_special_tokens=False)["input_ids"]
    )  # a new first piece
    assert tok._KNOWN.count(counting) == 1  # the remembered pieces are bounded


def test_tiny_fingerprint_matches_model_identity(tiny_model):
    assert tok.fingerprint(tok.load(tiny_model)) == lm_ops.load(tiny_model).identity.tokenizer_hash


def test_tiny_loads_without_torch_or_transformers(tiny_model, private_cache):
    expected = tok.fingerprint(tok.load_full(tiny_model))  # caches it, as model.load() does
    out = imports_after_load(tiny_model)
    assert out["light"] == "LightTokenizer" and out["fingerprint"] == expected
    assert out["text"] == "hello <|im_start|> wörld 😀"
    assert not out["torch"] and not out["transformers"]


def test_first_load_asks_transformers_once(tiny_model, private_cache):
    """With no cached fingerprint, load() pays for transformers once and caches it; a changed file
    is a new key (here the chat template, which the fingerprint covers)."""
    folder = tokenizer_copy(tiny_model, private_cache.parent / "tok")
    first = tok.load(str(folder))
    assert isinstance(first, LightTokenizer)
    assert len(list((private_cache / tok.FINGERPRINTS).iterdir())) == 1
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    second = tok.load(str(folder))
    assert isinstance(second, LightTokenizer) and second.fingerprint != first.fingerprint
    assert len(list((private_cache / tok.FINGERPRINTS).iterdir())) == 2
    assert_same(second, tok.load_full(str(folder)))
    # the light tokenizer's own fingerprint is cached per key too, and read, not computed again: a
    # wrong one there makes load() fall back to transformers' tokenizer, whose fingerprint is right
    light = list((private_cache / tok.LIGHT_FINGERPRINTS).iterdir())
    assert [f.read_text() for f in light] and {f.read_text() for f in light} == {first.fingerprint, second.fingerprint}
    for cached in light:
        cached.write_text("0" * 64)
    fallen = tok.load(str(folder))
    assert not isinstance(fallen, LightTokenizer) and tok.fingerprint(fallen) == second.fingerprint


def _template_in_config(folder: Path) -> None:  # transformers 4 kept it in tokenizer_config.json
    template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    (folder / "chat_template.jinja").unlink()
    edit_json(folder / "tokenizer_config.json", lambda c: c.update(chat_template=template))


def _named_templates_in_config(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()
    edit_json(
        folder / "tokenizer_config.json",
        lambda c: c.update(chat_template=[{"name": "default", "template": "A"}, {"name": "rag", "template": "B"}]),
    )


def _extra_template_file(folder: Path) -> None:
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}\r\n", encoding="utf-8")


def _no_template(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()


def _truncation_and_padding(folder: Path) -> None:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.enable_truncation(4)
    backend.enable_padding(length=64, pad_id=258, pad_token="<|im_end|>")
    backend.save(str(folder / "tokenizer.json"))


def _split_special_tokens(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", lambda c: c.update(split_special_tokens=True))


def _v4_class_name(folder: Path) -> None:
    edit_json(folder / "tokenizer_config.json", lambda c: c.update(tokenizer_class="PreTrainedTokenizerFast"))


@pytest.mark.parametrize(
    "variant",
    [
        _template_in_config,
        _named_templates_in_config,
        _extra_template_file,
        _no_template,
        _truncation_and_padding,
        _split_special_tokens,
        _v4_class_name,
    ],
)
def test_folder_variants_stay_light_and_equal(tiny_model, private_cache, variant):
    folder = tokenizer_copy(tiny_model, private_cache.parent / "tok")
    variant(folder)
    assert_same(tok.load(str(folder)), tok.load_full(str(folder)))


def _unflagged_special_token(folder: Path) -> None:
    def change(data):
        next(t for t in data["added_tokens"] if t["content"] == "<|im_start|>")["special"] = False

    edit_json(folder / "tokenizer.json", change)


@pytest.mark.parametrize(
    "mutation",
    [
        lambda folder: edit_json(
            folder / "tokenizer_config.json", lambda c: c.update(mask_token="<|mask|>")
        ),  # added at load
        _unflagged_special_token,  # marked special at load
        lambda folder: edit_json(
            folder / "tokenizer.json", lambda d: d.update(post_processor=None)
        ),  # one built at load
    ],
    ids=["special-token-missing", "special-token-unflagged", "no-post-processor"],
)
def test_backend_changed_by_transformers_falls_back(tiny_model, private_cache, mutation):
    """Where transformers changes the backend while loading, the file alone would hash
    differently, so load() hands back transformers' tokenizer."""
    folder = tokenizer_copy(tiny_model, private_cache.parent / "tok")
    mutation(folder)
    full = tok.load_full(str(folder))
    loaded = tok.load(str(folder))
    assert not isinstance(loaded, LightTokenizer)
    assert tok.fingerprint(loaded) == tok.fingerprint(full)
    assert tok.encode(loaded, "a<|mask|>b") == tok.encode(full, "a<|mask|>b")
    assert not isinstance(tok.load(str(folder)), LightTokenizer)  # the cached fingerprint keeps saying so


def test_other_tokenizer_class_uses_transformers(tiny_model, private_cache):
    folder = tokenizer_copy(tiny_model, private_cache.parent / "tok")
    edit_json(folder / "tokenizer_config.json", lambda c: c.pop("tokenizer_class"))
    assert not isinstance(tok.load(str(folder)), LightTokenizer)


def test_light_tokenizer_is_not_taken_for_a_full_one(tiny_model, private_cache):
    light = tok.load(tiny_model)
    assert isinstance(light, LightTokenizer)
    for attr in ("apply_chat_template", "backend_tokenizer", "decode", "encode", "__call__"):
        assert not hasattr(light, attr)
    with pytest.raises(TypeError, match="transformers' tokenizer"):
        chat.render(light, [{"role": "user", "content": "hi"}])
    full = tok.load_full(tiny_model)
    assert chat.render(full, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_missing_model_is_a_clear_error(tmp_path):
    from kvdb.errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="cannot load model"):
        tok.load(str(tmp_path / "no-such-model"))


@pytest.mark.model
def test_embedded_light_is_transformers(embedded):
    light = tok.load()
    assert_same(light, embedded.tokenizer)
    assert light.fingerprint == embedded.identity.tokenizer_hash


@pytest.mark.model
def test_embedded_loads_without_torch_or_transformers(embedded):
    tok.load()  # the cached fingerprint is there after model.load(); this makes sure
    out = imports_after_load(None)
    assert out["light"] == "LightTokenizer" and out["fingerprint"] == embedded.identity.tokenizer_hash
    assert out["ids"] == tok.encode(embedded.tokenizer, "hello <|im_start|> wörld 😀")
    assert not out["torch"] and not out["transformers"]
