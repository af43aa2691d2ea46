"""Phrase search in any casing, word by word and letter by letter (issue 54, item 1): the casing
walk against a scan of the lower-cased text, on the tiny byte-level model through the archive
and the CLI, and on SmolLM2's tokenizer over an index built here."""

import json
import random
import re

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import write

from kvdb.cli.main import main
from kvdb.index import casing
from kvdb.index import phrase as search_ops
from kvdb.index.walk import WalkIndex
from kvdb.model import tokenizer as tok

EXAMPLES = "We took the shinkansen from Tokyo to Kyoto with a JR Pass, and booked it on an iPhone."
SHORT = ["tokyo", "kyoto", "to", "jr", "pass", "iphone", "nasa", "osaka", "rail", "the", "ebay", "macos", "gpt", "a"]
LONG = [
    "javascript",
    "postgresql",
    "mcdonald",
    "sqlite",
    "youtube",
    "chatgpt",
    "openai",
    "github",
    "huggingface",
    "linkedin",
]
NAMED = {  # the casing text gives them: proper nouns, acronyms, camel case
    "tokyo": "Tokyo", "kyoto": "Kyoto", "jr": "JR", "pass": "Pass", "iphone": "iPhone", "nasa": "NASA",
    "osaka": "Osaka", "ebay": "eBay", "macos": "macOS", "gpt": "GPT", "javascript": "JavaScript",
    "postgresql": "PostgreSQL", "mcdonald": "McDonald", "sqlite": "SQLite", "youtube": "YouTube", "chatgpt": "ChatGPT",
    "openai": "OpenAI", "github": "GitHub", "huggingface": "HuggingFace", "linkedin": "LinkedIn",
}  # fmt: skip


def mixed(word: str, rng: random.Random) -> str:
    """A casing of ``word`` the walk looks for: any mixture of a short word, and for a longer one
    a casing of ``casing.word_casings`` (the mixtures text mostly takes), else its name's."""
    if len([c for c in word if c.isalpha()]) <= casing.MIXED_LETTERS:
        return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in word)
    return rng.choice([NAMED.get(word, word), *casing.word_casings(word)])


def corpus(rng: random.Random, sessions: int, words: int) -> list[str]:
    out = []
    for _ in range(sessions):
        said = []
        for _ in range(words):
            word = rng.choice(SHORT + LONG)
            said.append(NAMED.get(word, word) if rng.random() < 0.6 else mixed(word, rng))
            if rng.random() < 0.1:
                said[-1] += rng.choice([",", ".", ";"])
        out.append(" ".join(said))
    return out


def scan(texts: list[str], phrase: str) -> set[tuple[int, int]]:
    """(text, end character) of every occurrence of the phrase in the lower-cased text, overlapping."""
    want = phrase.lower()
    return {
        (t, m.start() + len(want))
        for t, text in enumerate(texts)
        for m in re.finditer(f"(?={re.escape(want)})", text.lower())
    }


# the tiny byte-level model: every substring is a token sequence ---------------------------------


@pytest.fixture
def said(archive):
    archive.ingest(text=EXAMPLES, name="trip")
    return archive


@pytest.mark.parametrize(
    ("typed", "written"),
    [
        ("tokyo to kyoto", "Tokyo to Kyoto"),
        ("jr pass", "JR Pass"),
        ("iphone", "iPhone"),
        ("IPHONE", "iPhone"),
        ("Jr PASS", "JR Pass"),
    ],
)
def test_the_examples_are_found_in_their_casing_and_not_when_case_sensitive(said, typed, written):
    [hit] = [h for h in said.search(typed, k=5) if h.exact]
    assert hit.match.strip() == written and hit.name == "trip"
    assert said.count(typed).count == 1
    assert not [h for h in said.search(typed, k=5, case_sensitive=True) if h.exact]
    assert said.count(typed, case_sensitive=True).count == 0
    assert said.count(written, case_sensitive=True).count == 1  # the casing as written, exactly


def test_the_cli_finds_the_examples_by_default_and_not_with_case_sensitive(tmp_path, tiny_model):
    runner, db = CliRunner(), str(tmp_path / "cli.duckdb")

    def run(*args):
        return runner.invoke(main, ["--db", db, *args], env={"KVDB_MODEL": tiny_model}, catch_exceptions=False)

    assert run("ingest", str(write(tmp_path / "trip.txt", EXAMPLES + "\n"))).exit_code == 0
    for typed, written in (("tokyo to kyoto", "Tokyo to Kyoto"), ("jr pass", "JR Pass"), ("iphone", "iPhone")):
        found = run("search", typed, "--json")
        assert found.exit_code == 0, found.output
        [row] = [json.loads(line) for line in found.stdout.splitlines() if json.loads(line)["exact"]]
        assert row["match"].strip() == written
        assert run("search", typed, "--count").stdout.strip() == "1"
        exact = run("search", typed, "--case-sensitive", "--json")
        assert exact.exit_code == 1 and not any(json.loads(line)["exact"] for line in exact.stdout.splitlines())
        assert run("search", typed, "--count", "--case-sensitive").stdout.strip() == "0"


@pytest.fixture
def texts(archive):
    said = corpus(random.Random(54), sessions=6, words=80)
    for n, text in enumerate(said):
        archive.ingest(text=text, name=f"t{n}")
    return archive, said


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_casing_mixture_is_found_as_a_scan_of_the_lower_cased_text_finds_it(texts, data):
    """Phrases cut from the text at word starts, typed in any casing: every place the lower-cased
    text holds the lower-cased phrase is a hit, and counted, and nothing else is."""
    archive, said = texts
    t = data.draw(st.integers(0, len(said) - 1))
    words = said[t].split(" ")
    at = data.draw(st.integers(0, len(words) - 1))
    span = words[at : at + data.draw(st.integers(1, 4))]
    phrase = "".join(c.upper() if data.draw(st.booleans()) else c.lower() for c in " ".join(span))
    truth = scan(said, phrase)
    assert archive.count(phrase).count == len(truth)
    names = {f"t{n}": n for n in range(len(said))}
    hits = [h for h in archive.search(phrase, k=len(truth) + 5, each_occurrence=True) if h.exact]
    found = {
        (names[h.name], h.position + h.match_tokens) for h in hits
    }  # a token a character: ASCII on a byte-level model
    assert found == truth
    assert all(h.match.lower() in (phrase.lower(), " " + phrase.lower()) for h in hits)


def test_word_casings_cover_short_words_letter_by_letter_and_long_ones_as_text_mostly_has_them():
    assert len(casing.word_casings("iphone")) == 64
    assert casing.word_casings("Tokyo")[:3] == ["Tokyo", "tokyo", "TOKYO"] and len(casing.word_casings("Tokyo")) == 32
    for word in LONG:
        assert NAMED[word] in casing.word_casings(word), word
        assert NAMED[word] in casing.word_casings(word.upper())
    assert casing.word_casings("42.") == ["42."]
    assert "STRASSE" in casing.word_casings("straße")
    assert casing.units("tokyo to  kyoto ") == ["tokyo", " to", "  kyoto", " "]


# SmolLM2's tokenizer: byte-level BPE, each word tokenized with the space before it ----------------


@pytest.fixture(scope="module")
def smol():
    return tok.load()


def test_smollm2_tokenizes_a_phrase_as_its_words_one_after_the_other(smol):
    """What the walk assumes, where it holds: words after punctuation, numbers, brackets, line
    breaks, apostrophes in any case, non-ASCII letters, several spaces."""
    for phrase in [
        "Tokyo to Kyoto",
        "tokyo, to KYOTO.",
        "JR-Pass 2024 (iPhone)",
        "DON'T stop",
        "don't Stop",
        "Straße STRASSE",
        "İstanbul ıi",
        "café  au\nlait",
        "ＴＯＫＹＯ tokyo",
        "x=1; y",
    ]:
        for form in {phrase, phrase.lower(), phrase.upper(), casing.title(phrase)}:
            whole = tok.encode(smol, form)
            parts = [i for unit in casing.units(form) for i in tok.encode(smol, unit)]
            assert whole == parts, form


def smol_index(smol, said: list[str]) -> tuple[WalkIndex, list[np.ndarray]]:
    """An index of each text's tokens, and each token's end character in its text, by slot."""
    index, ends = WalkIndex(49152), []
    for text in said:
        encoded = smol.backend.encode(text, add_special_tokens=False)
        index.add(np.asarray(encoded.ids, np.int64))
        ends.append(np.array([end for _, end in encoded.offsets]))
    return index, ends


@pytest.fixture(scope="module")
def smol_texts(smol):
    said = corpus(random.Random(7), sessions=8, words=300)
    return said, *smol_index(smol, said)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_smollm2_finds_every_casing_of_a_phrase_a_scan_of_the_lower_cased_text_finds(smol, smol_texts, data):
    """On SmolLM2's tokens: every occurrence of the lower-cased phrase that begins and ends at a
    word's edge is found and counted; every one found is an occurrence (inside a word too)."""
    said, index, ends = smol_texts
    t = data.draw(st.integers(0, len(said) - 1))
    words = said[t].split(" ")
    at = data.draw(st.integers(0, len(words) - 1))
    span = " ".join(words[at : at + data.draw(st.integers(1, 4))]).strip(",.;")
    phrase = "".join(c.upper() if data.draw(st.booleans()) else c.lower() for c in span)
    own = [np.asarray(tok.encode(smol, text), np.int64) for text in (phrase, " " + phrase)]
    variants, known = casing.variants(smol, index, phrase, own)
    slots = np.concatenate(
        [
            search_ops.bounded(index, [variants[v]], known)[variants[v].tobytes()].slots()
            for v in search_ops.unsuffixed(variants)
        ]
    )
    first = np.cumsum([0, *(len(e) for e in ends)])
    text_of = np.searchsorted(first, slots, side="right") - 1
    found = {(int(n), int(ends[n][s - first[n]])) for n, s in zip(text_of, slots)}
    assert len(found) == len(slots)  # each place once
    anywhere = scan(said, phrase)
    bounded = {
        (n, end)
        for n, end in anywhere
        if (end - len(phrase) == 0 or said[n][end - len(phrase) - 1] == " ")
        and (end == len(said[n]) or not said[n][end].isalnum())
    }
    assert bounded <= found <= anywhere


def test_many_bounds_at_once_bisect_blocks_and_agree_with_one_at_a_time(smol_texts):
    """Past ``BISECT_KEYS`` bounds a call bisects each block (the walk's rounds): the same bounds
    as one piece at a time, which derives the block whole; ``holds`` agrees with them."""
    _, index, _ = smol_texts
    rng = np.random.default_rng(0)
    tokens = np.asarray(index.tokens[: index.ntotal], np.int64)
    pieces = [
        tokens[a : a + n]
        for a, n in zip(rng.integers(0, len(tokens) - 8, 150).tolist(), rng.integers(1, 7, 150).tolist())
    ]
    pieces += [rng.integers(0, 49152, n) for n in rng.integers(1, 5, 150).tolist()]  # mostly absent
    many = index.bounds(pieces).sizes()
    alone = np.array([len(index.ranges([piece])[0][0]) for piece in pieces])
    assert (many == alone).all() and (alone[:150] > 0).mean() > 0.9 and (alone[150:] == 0).any()
    short = [piece for piece in pieces if len(piece) <= index.depth]
    assert (index.holds(short) == (np.array([len(index.ranges([piece])[0][0]) for piece in short]) > 0)).all()
