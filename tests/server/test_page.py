"""The page of `kvdb serve` in headless Chromium (Debian's, which `make install` installs): the
API key field, the session list, a session's turns shown as text even where a transcript holds
HTML, search hits in a <mark>, a hit opened in its session, and a reply streamed into the page.

KVDB_SCREENSHOT=1 saves the page at the end of the walk through to docs/serve-page.png."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright
from support import REPO, write, write_jsonl

import kvdb

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (`make install` installs it)")]

# without the background-networking flags chromium's own connections are refused by a closed network
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "page-test-key"
HOSTILE = "<script>window.__pwned = 1</script> and <b>bold</b>"
CHAT = [
    {"role": "user", "content": f"Please keep this markup as it is: {HOSTILE}"},
    {"role": "assistant", "content": "Kept as text: the page shows it literally."},
]
PHRASE = "codebooks hold the keys"
STORY = (  # the phrase with more than the page's 160 tokens of context on each side
    "The lighthouse keeper counted the ships every night and wrote their names in a ledger.\n" * 3
    + f"Residual {PHRASE} of every archived token.\n"
    + "In the morning the harbour master read the ledger aloud to the fishermen on the quay.\n" * 3
)
SLOW = 60_000  # ms: the first reply of a server restores its session first, on 2 cores


@pytest.fixture
def running(serve, tmp_path, tiny_loaded):
    """`kvdb serve` with an API key, over an archive of a chat that holds HTML and a text story."""
    write_jsonl(tmp_path / "t" / "markup.jsonl", CHAT)
    write(tmp_path / "t" / "story.txt", STORY)
    with kvdb.open(tmp_path / "serve.duckdb", model=tiny_loaded) as archive:
        assert {r.status for r in archive.ingest(tmp_path / "t")} == {"ingested"}
    return serve(api_key=KEY)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def context(browser):
    """A fresh profile (no key stored) whose pages must raise no error."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    errors = []
    context.on("weberror", lambda error: errors.append(error.error))
    yield context
    context.close()
    assert errors == []


@pytest.fixture
def page(context, running):
    """The page, its key given in its key field."""
    page = context.new_page()
    page.goto(running.url)
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    page.get_by_test_id("session").first.wait_for()
    return page


def _api(running, path: str, **params) -> dict:
    with running.http(Authorization=f"Bearer {KEY}") as client:
        response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_key_field_is_sent_and_kept(context, running):
    page = context.new_page()
    page.goto(running.url)
    expect(page.locator("#status")).to_contain_text("401: this server needs an API key")
    assert page.get_by_test_id("session").count() == 0

    page.fill("#api-key", "wrong")
    page.click("#key-form button")
    expect(page.locator("#status")).to_contain_text("401: incorrect API key")

    page.fill("#api-key", KEY)
    page.click("#key-form button")
    expect(page.get_by_test_id("session")).to_have_count(2)
    expect(page.locator("#status")).to_be_empty()
    page.reload()  # the key stays in the profile's localStorage
    expect(page.get_by_test_id("session")).to_have_count(2)
    assert page.input_value("#api-key") == KEY


def test_sessions_listed_and_markup_shown_as_text(page, running):
    listed = _api(running, "/api/sessions")["sessions"]
    sessions = page.get_by_test_id("session")
    assert [s.get_attribute("data-session-id") for s in sessions.all()] == [s["session_id"] for s in listed]
    assert sessions.locator(".name").all_text_contents() == ["markup", "story"]

    sessions.filter(has_text="markup").click()
    turns = page.get_by_test_id("turn")
    expect(turns).to_have_count(2)
    shown = _api(running, f"/api/sessions/{listed[0]['session_id']}")
    assert [t.get_attribute("data-role") for t in turns.all()] == [t["role"] for t in shown["turns"]] == ["user", "assistant"]
    assert page.text_content("#session-range span") == f"tokens 0–{shown['end']} of {shown['end']}" and page.locator("#session-all").is_hidden()
    turns.first.locator(".here").click()
    assert page.input_value("#continue-at") == str(shown["turns"][0]["end"])
    assert HOSTILE in turns.first.text_content() and "<script>" in page.text_content("#turns")
    assert page.evaluate("window.__pwned") is None
    assert page.locator("main script, main b").count() == 0


def test_search_opens_hit_in_context_and_continues_streaming(page, running):
    page.fill("#search-q", PHRASE)
    page.click("#search-form button")
    hits = page.get_by_test_id("hit")
    hits.first.wait_for()
    found = _api(running, "/api/search", q=PHRASE, k=10)["hits"]
    expect(hits).to_have_count(len(found))
    hit, expected = hits.first, found[0]
    assert expected["exact"] and expected["name"] == "story" and "partial" not in hit.get_attribute("class")
    assert hit.locator("mark").text_content() == expected["match"] == PHRASE
    assert hit.locator(".snippet").text_content() == expected["before"] + expected["match"] + expected["after"]

    hit.get_by_test_id("hit-open").click()
    expect(page.locator("#turns mark")).to_have_text(PHRASE)
    at = expected["position"] + expected["match_tokens"]
    window = _api(running, f"/api/sessions/{expected['session_id']}", start=expected["position"] - 160, end=at + 160)
    assert page.text_content("#session-title") == "story" and page.text_content("#turns .text") == window["text"]
    assert page.text_content("#session-range span") == f"tokens {window['start']}–{window['end']} of {window['session']['n_tokens']}"
    assert page.input_value("#continue-at") == str(at)

    # sampling pinned (greedy) on the way out, so the streamed reply can be compared with the same request answered at once
    sent = []

    def greedy(route):
        sent.append(route.request.post_data_json)
        route.continue_(post_data=json.dumps(sent[-1] | {"temperature": 0}))

    page.route("**/v1/chat/completions", greedy)
    page.fill("#continue-prompt", "What do the codebooks hold?")
    page.click("#continue-go")
    expect(page.locator("body")).not_to_have_class("busy", timeout=SLOW)
    asked = {"model": "kvdb", "messages": [{"role": "user", "content": "What do the codebooks hold?"}], "stream": True, "max_tokens": 64, "kvdb": {"session": expected["session_id"], "at": at}}
    assert sent == [asked]
    expect(page.locator("#status")).to_be_empty()
    with running.http(Authorization=f"Bearer {KEY}") as client:
        answered = client.post("/v1/chat/completions", json=asked | {"stream": False, "temperature": 0}).json()
    reply = answered["choices"][0]["message"]["content"]
    assert reply and page.text_content("#reply") == reply
    if os.environ.get("KVDB_SCREENSHOT"):
        page.screenshot(path=str(REPO / "docs" / "serve-page.png"), full_page=True)

    page.click("#session-all")
    expect(page.locator("#session-range span")).to_have_text(f"tokens 0–{window['session']['n_tokens']} of {window['session']['n_tokens']}")
    assert page.text_content("#turns .text") == STORY and page.locator("#turns mark").count() == 0 and page.locator("#session-all").is_hidden()


def test_partial_hits_marked_partial(page):
    page.fill("#search-q", "zzz the keys")  # a partial hit matches at least half the phrase (min_share)
    page.click("#search-form button")
    hit = page.get_by_test_id("hit").first
    hit.wait_for()
    assert "partial" in hit.get_attribute("class").split()
    assert hit.locator(".grade").text_content().startswith("partial: ")
    assert "the keys" in hit.locator("mark").text_content()


def test_search_by_meaning_and_one_click_to_continue_from_a_hit(page, running):
    page.check("#search-meaning")
    page.fill("#search-q", "ships counted at night")
    page.click("#search-form button")
    hits = page.get_by_test_id("hit")
    hits.first.wait_for()
    found = _api(running, "/api/search", q="ships counted at night", k=10, semantic=1)["hits"]
    expect(hits).to_have_count(len(found))
    first = found[0]
    assert hits.first.locator(".grade").text_content() == f"score {first['score']:.3f}"

    hits.first.get_by_test_id("hit-continue").click()
    expect(page.locator("#continue-prompt")).to_be_focused()
    at = first["position"] + first["match_tokens"]
    assert page.input_value("#continue-at") == str(at) and page.text_content("#session-title") == first["name"]
    shown = _api(running, f"/api/sessions/{first['session_id']}", start=first["position"], end=at)
    expect(page.locator("#turns mark")).to_have_text(shown["text"])  # the chunk marked as the view renders it
