"""The generation loop: one token at a time onto a cache, chosen as the request's sampling
says, its text handed on as it grows so a reply can be streamed.

Text is held back while it could still change: a trailing incomplete UTF-8 sequence (decoded
as U+FFFD until its last byte comes) and the last characters that might begin a stop string.
A token's log-probability, when asked for, goes with the first delta sent after it: tokens
wholly inside a stop string, and EOS, are not part of the reply and have none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvdb.model import loading as lm_ops
from kvdb.model.loading import LoadedModel
from kvdb.services.write_compute import Computed
from kvdb.serving.params import Sampling
from kvdb.serving.responses import Logprobs, TokenLogprob

UNFINISHED = "\ufffd"


@dataclass(frozen=True)
class Delta:
    """The reply's next piece of text, and the log-probabilities of the tokens it completes
    (None unless asked for)."""

    text: str
    logprobs: Logprobs = None


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token: the most likely at temperature 0, else drawn from the tempered
    distribution cut to its nucleus (the most likely tokens whose mass before them is under top_p).
    ``sampling`` is ``defaulted``: it names both."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    assert sampling.temperature is not None and sampling.top_p is not None
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p >= 1:
        return int(torch.multinomial(probs, 1, generator=generator))
    ordered, order = torch.sort(probs, descending=True)
    ordered[torch.cumsum(ordered, 0) - ordered >= sampling.top_p] = 0
    return int(order[torch.multinomial(ordered, 1, generator=generator)])


def eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """Tokens that end a reply: the tokenizer's EOS and those the model's generation config names."""
    config = getattr(loaded.model, "generation_config", None)
    named = getattr(config, "eos_token_id", None)
    named = named if isinstance(named, (list, tuple)) else [named]
    return frozenset(int(t) for t in [loaded.tokenizer.eos_token_id, *named] if t is not None)


def model_sampling(loaded: LoadedModel) -> Sampling:
    """The temperature and top_p a request that names none gets: the model's generation
    config's, as transformers' ``generate`` reads them (greedy where it says ``do_sample:
    false``), else the OpenAI API's 1.0."""
    config = getattr(loaded.model, "generation_config", None)
    temperature, top_p = getattr(config, "temperature", None), getattr(config, "top_p", None)
    if getattr(config, "do_sample", None) is False:
        temperature = 0.0
    return Sampling(temperature=1.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p)


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for. A byte-level BPE token spells its bytes in the GPT-2
    alphabet; SentencePiece's byte fallback is ``<0xNN>``; otherwise its text, where a token
    that is part of a character decodes as U+FFFD."""
    piece = tokenizer.convert_ids_to_tokens(token)
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if "ByteLevel" in repr(decoder) and isinstance(piece, str) and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return cast(str, tokenizer.decode([token], clean_up_tokenization_spaces=False)).encode()


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the
    rest for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_LEVEL = _byte_level()


class Generation:
    """A reply to ``ids``, generated onto ``cache`` (which holds a prefix of them; None: nothing).

    Iterate ``deltas()`` for its text as it grows. Afterwards: ``text``; ``finish_reason``
    ("stop": EOS or a stop string, "length": ``max_tokens``, "cancelled": ``cancelled()`` said
    so); ``tokens``, the ids generated; ``logprobs``, those of the reply's tokens when
    ``top_logprobs`` is not None (with that many alternatives each); ``cache``, holding ``fed``
    (the prompt and every generated token but the last, which was never run); ``computed``, the
    whole pass as the archive takes it, so the exchange is archived without running the model
    over it again."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache,
        ids: np.ndarray,
        sampling: Sampling,
        max_tokens: int,
        cancelled: Callable[[], bool],
        top_logprobs: int | None = None,
    ):
        self._loaded = loaded
        self.cache = cache
        self._ids = np.asarray(ids, dtype=np.int64)
        self._sampling = sampling.defaulted(model_sampling(loaded))
        self._max_tokens = max_tokens
        self._cancelled = cancelled
        self._top = top_logprobs
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        # ln p of the prompt's tokens from ``_scored`` on, then of each generated token
        self._scores: list[np.ndarray] = []
        self._scored = 0
        self.text = ""
        self.finish_reason = "length"

    @property
    def fed(self) -> np.ndarray:
        return np.concatenate([self._ids, np.asarray(self.tokens, dtype=np.int64)])[
            : len(self._ids) + len(self.tokens) - 1
        ]

    @property
    def computed(self) -> Computed:
        ids = np.concatenate([self._ids, np.asarray(self.tokens, dtype=np.int64)])
        return Computed(ids, np.concatenate(self._scores).astype(np.float32), self._scored, self.cache)

    @torch.no_grad()
    def deltas(self) -> Iterator[Delta]:
        model, tokenizer = self._loaded.model, self._loaded.tokenizer
        stops, eos = self._sampling.stop, eos_ids(self._loaded)
        hold = max(map(len, stops), default=1) - 1  # characters that may yet turn out to begin a stop string
        generator = torch.Generator()
        if self._sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self._sampling.seed)
        held = 0 if self.cache is None else self.cache.get_seq_length()
        if held:  # its last token is run again: the logits before the first new token give its log-probability too
            self.cache.crop(-1)
        self._scored = held
        prompt, self.cache, logits = lm_ops.score_and_next(model, self._ids, held, self.cache)
        self._scores.append(prompt)
        step, sent, given, text = None, 0, 0, ""
        for _ in range(self._max_tokens):
            if self._cancelled():
                self.finish_reason = "cancelled"
                return
            if step is not None:
                logits = model(step, cache=self.cache, use_cache=True).logits[0, -1]
            token = pick(logits, self._sampling, generator)
            self.tokens.append(token)
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            self._scores.append(logprobs[token : token + 1].numpy())
            if token in eos:
                self.finish_reason = "stop"
                break
            if self._top is not None:
                self.logprobs.append(self._logprob(logprobs, token, len(text)))
            text = cast(
                str, tokenizer.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            )  # one sequence: one string
            cut = min((i for i in (text.find(s, max(0, sent - hold)) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text, self.finish_reason = text[:cut], "stop"
                # those wholly in the stop string are not the reply's
                self.logprobs = [t for t in self.logprobs if t.offset < cut]
                break
            ready = min(len(text) - hold, len(text.rstrip(UNFINISHED)))
            if ready > sent:
                yield Delta(text[sent:ready], self._since(given))
                sent, given = ready, len(self.logprobs)
            step = torch.tensor([[token]])
        self.text = text
        if len(text) > sent or len(self.logprobs) > given:
            yield Delta(text[sent:], self._since(given))

    def _since(self, given: int) -> Logprobs:
        return tuple(self.logprobs[given:]) if self._top is not None else None

    def _logprob(self, logprobs: torch.Tensor, token: int, offset: int) -> TokenLogprob:
        tokenizer = self._loaded.tokenizer
        top = torch.topk(logprobs, self._top) if self._top else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
        return TokenLogprob(
            token_bytes(tokenizer, token),
            float(logprobs[token]),
            offset,
            tuple((token_bytes(tokenizer, t), p) for t, p in alternatives),
        )
