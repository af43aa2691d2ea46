"""Completions through the official `openai` client: chat and text, streamed and not, sampling
and stop strings, and prompts resumed from what was computed or archived before."""

from __future__ import annotations

import numpy as np
import pytest
from support import CALIBRATION, KV

import kvdb
from kvdb.model import capture
from kvdb.model import chat as chat_template
from kvdb.model import loading as lm_ops
from kvdb.model import tokenizer as tok
from kvdb.serving.generation import token_bytes

HELLO = [{"role": "user", "content": "Tell me about the harbour."}]


def _kvdb(response) -> dict:
    """Where the reply's prompt was restored from (its fidelity and conversation are checked apart)."""
    return {k: v for k, v in response.to_dict()["kvdb"].items() if k not in ("fidelity", "conversation_id")}


def _kvdb_of(response) -> dict:
    return response.to_dict()["kvdb"]


def test_chat_streamed_and_not_give_the_same_greedy_reply(serve):
    running = serve()
    first = running.chat(HELLO)
    choice = first.choices[0]
    assert (
        first.object == "chat.completion"
        and choice.message.role == "assistant"
        and choice.finish_reason in ("stop", "length")
    )
    assert first.usage.prompt_tokens > 0 and 1 <= first.usage.completion_tokens <= 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and _kvdb(first) == {
        "restored": "none",
        "cached_tokens": 0,
        "approximate": False,
    }

    chunks = list(running.chat(HELLO, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    usage = chunks[-1].usage  # the usage chunk comes last, without choices
    assert chunks[-1].choices == [] and usage.prompt_tokens == first.usage.prompt_tokens
    # the same prompt again: all of it but the last token (which must be run for its logits) is held in memory
    assert usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


def test_text_completions_with_seed_and_stop(serve):
    client = serve().openai()
    greedy = client.completions.create(model="kvdb", prompt="The harbour master", max_tokens=12, temperature=0)
    assert greedy.object == "text_completion" and greedy.usage.completion_tokens >= 1
    streamed = client.completions.create(
        model="kvdb", prompt="The harbour master", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == greedy.choices[0].text

    sampled = [
        client.completions.create(
            model="kvdb", prompt="The harbour master", max_tokens=12, temperature=1, top_p=0.9, seed=seed
        )
        .choices[0]
        .text
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]

    text = greedy.choices[0].text
    stop = text[3:5] if len(text) >= 5 else None
    if stop:  # the greedy reply cut where the stop string begins, the stop string left out
        cut = client.completions.create(
            model="kvdb", prompt="The harbour master", max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_second_turn_resumes_the_archived_first_in_memory_and_after_a_restart(serve, tiny_loaded):
    running = serve()
    first = running.chat(HELLO, max_tokens=6)
    [archived] = running.wait_archived(1)
    turn_two = [
        *HELLO,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the ships?"},
    ]
    second = running.chat(turn_two, max_tokens=4)
    assert _kvdb(second) == {"restored": "exact", "cached_tokens": archived["n_tokens"], "approximate": False}
    # only the new turn was computed: the archived exchange is exactly the start of this prompt
    ids = tok.encode(
        tiny_loaded.tokenizer, chat_template.render(tiny_loaded.tokenizer, turn_two, add_generation_prompt=True)
    )
    assert second.usage.prompt_tokens == len(ids) and len(ids) - archived["n_tokens"] == len(
        tok.encode(tiny_loaded.tokenizer, chat_template.user_turn_suffix(tiny_loaded.tokenizer, "And the ships?"))
    )

    running.wait_archived(2)
    [conversation] = running.get("/api/conversations")["conversations"]  # the second turn grew the first's conversation
    assert conversation["versions"] == 2 and conversation["conversation_id"] == _kvdb_of(first)["conversation_id"]
    running.stop()
    restarted = serve(db=running.db)  # nothing in memory: the second exchange's cache, kept on disk, holds this prompt
    again = restarted.chat(turn_two, max_tokens=4)
    assert _kvdb(again) == {"restored": "exact", "cached_tokens": len(ids) - 1, "approximate": False}
    assert again.choices[0].message.content == second.choices[0].message.content


def test_continue_a_named_session_at_a_position(serve, tmp_path, tiny_loaded):
    db = tmp_path / "serve.duckdb"
    story = "The lighthouse keeper counted the ships every night, and wrote their names down."
    with kvdb.open(db, model=tiny_loaded) as archive:
        archive.ingest(text=story, name="story")
    running = serve(db=db)
    ask = [{"role": "user", "content": "Who counted?"}]
    reply = running.chat(ask, extra_body={"kvdb": {"session": "story", "at": 24}})
    suffix = tok.encode(tiny_loaded.tokenizer, chat_template.user_turn_suffix(tiny_loaded.tokenizer, "Who counted?"))
    assert reply.usage.prompt_tokens == 24 + len(suffix)
    again = running.chat(ask, extra_body={"kvdb": {"session": "story", "at": 24}})
    assert (
        _kvdb(again)["cached_tokens"] == 24 + len(suffix) - 1
        and again.choices[0].message.content == reply.choices[0].message.content
    )

    versions = running.wait_archived(2)  # the same exchange twice is one session
    [original] = [s for s in versions if s["n_tokens"] == len(tok.encode(tiny_loaded.tokenizer, story))]
    [fork] = [s for s in versions if s is not original]
    assert (
        fork["name"] == "story"
        and fork["conversation_id"] == original["conversation_id"] == reply.to_dict()["kvdb"]["conversation_id"]
    )
    history = running.get("/api/conversations/story")["history"]  # a fork of the story, after its first 24 tokens
    assert [(v["session_id"], v["branch_of"], v["forked_at"], v["leaf"]) for v in history] == [
        (original["session_id"], None, None, True),
        (fork["session_id"], original["session_id"], 24, True),
    ]
    continued = running.get(f"/api/sessions/{fork['session_id']}")
    assert continued["text"].startswith(story[:24]) and continued["text"].endswith(
        reply.choices[0].message.content + "<|im_end|>\n"
    )
    assert (
        continued["turns"][-1]["text"] == reply.choices[0].message.content
    )  # a turn shows what was said, not the template's markup
    prefix = running.get(f"/api/sessions/{fork['session_id']}", end=24)
    assert prefix["text"] == story[:24] and [t["role"] for t in prefix["turns"]] == [None]


@pytest.mark.parametrize("restore", ["archive", "auto"])
def test_restore_archive_resumes_from_tier_k_and_says_it_is_approximate(serve, tmp_path, tiny_loaded, restore):
    """``auto`` follows ``kvdb restore``'s rule: codebooks trained on the archive are measured by
    nobody, so their tier K is not resumed from; ``archive`` takes it all the same."""
    db = tmp_path / "serve.duckdb"
    talk = [
        {"role": "user", "content": "What does the archive keep of each key?"},
        {"role": "assistant", "content": "A few codebook indices per head."},
    ]
    with kvdb.open(db, model=tiny_loaded) as archive:
        archive.ingest(text=CALIBRATION, name="calibration")
        archive.train_codebooks(preset="balanced", tokens=2000, niter=4)  # the preset serve's exchanges are coded with
        [stored] = archive.ingest(messages=talk, keep=KV)
    running = serve(db=db, restore=restore, keep=KV)
    reply = running.chat([*talk, {"role": "user", "content": "And of each value?"}])
    if restore == "auto":
        assert _kvdb(reply)["restored"] != "archive" and not _kvdb(reply)["approximate"]
        return
    recomputed = capture.SINKS + capture.RECENT  # tier K's exact window is computed, not restored
    assert _kvdb(reply) == {"restored": "archive", "cached_tokens": stored.n_tokens - recomputed, "approximate": True}
    assert (
        reply.to_dict()["kvdb"]["fidelity"] == "balanced (k6v4), not measured"
    )  # codebooks trained here: nobody measured them
    assert reply.usage.prompt_tokens_details.cached_tokens == stored.n_tokens - recomputed


def _legacy_bytes(token: str) -> bytes:
    """A legacy logprobs token back to its bytes (a part of a character is written ``bytes:\\x98``)."""
    return bytes.fromhex(token[len("bytes:") :].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


def test_chat_logprobs_are_the_models_own_streamed_and_not(serve, tiny_loaded):
    running = serve()
    reply = running.chat(HELLO, max_tokens=6, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens - (
        choice.finish_reason == "stop"
    )  # EOS is not part of the reply
    assert (
        b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == choice.message.content
    )  # the random model's bytes need not be UTF-8
    tokenizer = tiny_loaded.tokenizer
    id_of = {token_bytes(tokenizer, i): i for i in range(len(tokenizer))}
    ids = tok.encode(tokenizer, chat_template.render(tokenizer, HELLO, add_generation_prompt=True))
    expected, _ = lm_ops.score(
        tiny_loaded.model, np.asarray(ids + [id_of[bytes(t.bytes)] for t in content]), start=len(ids)
    )
    np.testing.assert_allclose([t.logprob for t in content], expected, atol=1e-4)
    for t in content:  # greedy: the chosen token is the most likely, listed first among 3
        assert (
            len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        )
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob

    chunks = list(running.chat(HELLO, max_tokens=6, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # the same tokens and alternatives; the values to float rounding (the second reply resumes from the first's cache)
    assert [(t.token, t.bytes, [a.token for a in t.top_logprobs]) for t in streamed] == [
        (t.token, t.bytes, [a.token for a in t.top_logprobs]) for t in content
    ]
    np.testing.assert_allclose(
        [[a.logprob for a in t.top_logprobs] for t in streamed],
        [[a.logprob for a in t.top_logprobs] for t in content],
        atol=1e-4,
    )
    plain = running.chat(HELLO, max_tokens=6)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_text_logprobs_in_the_legacy_shape_streamed_and_not(serve):
    client = serve().openai()
    reply = client.completions.create(
        model="kvdb", prompt="The harbour master", max_tokens=6, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    got = choice.logprobs
    assert b"".join(map(_legacy_bytes, got.tokens)).decode(errors="replace") == choice.text
    assert len(got.token_logprobs) == len(got.tokens) == len(got.top_logprobs) == len(got.text_offset)
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)
    for token, logprob, top in zip(got.tokens, got.token_logprobs, got.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == logprob == top[token]  # greedy: the most likely
    streamed = list(
        client.completions.create(
            model="kvdb", prompt="The harbour master", max_tokens=6, temperature=0, logprobs=2, stream=True
        )
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == got.tokens and [
        o for p in pieces for o in p.text_offset
    ] == got.text_offset


def test_logprobs_end_where_a_stop_string_cuts_the_reply(serve):
    client = serve().openai()
    whole = client.completions.create(
        model="kvdb", prompt="The harbour master", max_tokens=12, temperature=0, logprobs=0
    )
    text, got = whole.choices[0].text, whole.choices[0].logprobs
    assert len(got.tokens) >= 4 and not any(t.startswith("bytes:") for t in got.tokens[:4]), (
        "the greedy reply does not suit a cut"
    )
    stop = "".join(got.tokens[2:4])
    cut = client.completions.create(
        model="kvdb", prompt="The harbour master", max_tokens=12, temperature=0, logprobs=0, stop=[stop]
    )
    at = text.index(stop)
    assert cut.choices[0].text == text[:at] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].logprobs.tokens == [
        t for t, o in zip(got.tokens, got.text_offset, strict=True) if o < at
    ]  # none of the stop string's
