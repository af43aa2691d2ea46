"""The page of `kvdb serve` in headless Chromium (Debian's, which `make install` installs), at
1,440 px and at 390 px: the API key field; the conversations listed, a conversation's turns shown
as chat turns, as text even where a transcript holds HTML; a new chat of three turns, each reply
streamed with how its start was restored under it; a reload, which lists the chat and reopens it;
search by meaning, a hit opened in its conversation and continued; a branch from a turn, which a
reload offers as a version; rename and delete. axe-core (the axe-playwright-python package's copy)
checks labels, names, ARIA and contrast at each step. The tiny model's replies are gibberish: what
is checked is the page against the API's own answers, not what the replies say.

docs/make_screenshots.py takes the docs' screenshots of the page with the embedded model."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright
from support import write, write_jsonl

import kvdb

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (`make install` installs it)"
    ),
]

# without the background-networking flags chromium's own connections are refused by a closed network
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "page-test-key"
HOSTILE = "<script>window.__pwned = 1</script> and <b>bold</b>"
CHAT = [
    {"role": "user", "content": f"Please keep this markup as it is: {HOSTILE}"},
    {"role": "assistant", "content": "Kept as text: the page shows it literally."},
]
STORY = "The lighthouse keeper counted the ships every night and wrote their names in a ledger.\n" * 3
SLOW = 60_000  # ms: a reply of a server that restores its session first, on 2 cores
WIDTHS = {"wide": (1440, 900), "narrow": (390, 844)}
# what axe-core must find nothing of: contrast, labels and names of controls, ARIA
AXE_RULES = {
    "color-contrast",
    "label",
    "button-name",
    "select-name",
    "link-name",
    "input-button-name",
    "summary-name",
    "nested-interactive",
    "duplicate-id-aria",
}
RESTORED = re.compile(
    r"^(Started from [\d,]+ tokens? already computed \(exact\)\."
    r"|Started from [\d,]+ tokens? restored from the archive \(.+\)\."
    r"|Computed the whole prompt: none of it was cached\.)$"
)
OPENS = {"exact": "Started from", "archive": "Started from", "none": "Computed the whole prompt"}


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


@pytest.fixture(scope="module")
def axe():
    from axe_playwright_python.sync_playwright import Axe

    return Axe()


def _context(browser, width: int, height: int):
    """A fresh profile (no key stored) whose pages must raise no error."""
    context = browser.new_context(viewport={"width": width, "height": height})
    errors: list = []
    context.on("weberror", lambda error: errors.append(error.error))
    return context, errors


@pytest.fixture(params=list(WIDTHS))
def page(request, browser, running):
    """The page at each width, its key given in its key field."""
    context, errors = _context(browser, *WIDTHS[request.param])
    page = context.new_page()
    page.goto(running.url)
    expect(page.get_by_placeholder("API key")).to_be_visible()  # named at any width (at 390 px its label is hidden)
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    _show_list(page)
    page.get_by_test_id("conversation").first.wait_for()
    yield page
    context.close()
    assert errors == []


def _api(running, path: str, **params) -> dict:
    with running.http(Authorization=f"Bearer {KEY}") as client:
        response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _show_list(page) -> None:
    """On a narrow screen the list is a panel the header's toggle opens."""
    toggle = page.locator("#list-toggle")
    if toggle.is_visible() and toggle.get_attribute("aria-expanded") != "true":
        toggle.click()
    expect(page.locator("#conversations")).to_be_visible()


def _check_axe(axe, page) -> None:
    found = axe.run(page).response["violations"]
    failing = [v for v in found if v["id"] in AXE_RULES or v["id"].startswith("aria-")]
    assert failing == [], json.dumps(
        [{"id": v["id"], "help": v["help"], "nodes": [n["target"] for n in v["nodes"]]} for v in failing], indent=1
    )


def _no_horizontal_scroll(page) -> None:
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "the page scrolls sideways"
    top = page.locator("header.top").bounding_box()
    assert top and top["height"] < 60, f"the header wraps: {top}"


def _sse(body: str) -> tuple[str, dict]:
    """A streamed reply's text and the kvdb report of its last chunk."""
    text, report = "", {}
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            text += "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
            report = chunk.get("kvdb") or report
    return text, report


def _say(page, sent: list, text: str) -> tuple[dict, str, dict]:
    """Type a message and send it with Enter; the request, the reply's text and its kvdb report,
    once the reply shows how its start was restored."""
    replies = page.get_by_test_id("restored").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    expect(page.get_by_test_id("restored")).to_have_count(replies + 1, timeout=SLOW)
    reply, report = _sse(sent[-1]["answer"])
    last = page.get_by_test_id("turn").last
    assert last.get_attribute("data-role") == "assistant"
    assert last.locator(".body").text_content().strip() == reply.strip()
    note = last.get_by_test_id("restored").text_content()
    assert RESTORED.match(note), note
    assert note.startswith(OPENS[report["restored"]]) and ("exact" in note) == (report["restored"] == "exact")
    assert f"{report['cached_tokens']:,} token" in note or report["restored"] == "none"
    expect(last).to_be_in_viewport()
    expect(page.locator("#status")).to_be_empty()
    return sent[-1]["asked"], reply, report


def _record(page) -> list:
    """The page's requests for a reply, each with the server's answer (the events all at once:
    the browser cannot read back a stream it consumed), which the page is then given."""
    sent: list = []

    def keep(route):
        answer = route.fetch(timeout=SLOW)
        sent.append({"asked": route.request.post_data_json, "answer": answer.text()})
        route.fulfill(response=answer)

    page.route("**/v1/chat/completions", keep)
    return sent


def _embedded(running, seconds: float = 60) -> None:
    """Once the server's idle time has embedded every session (ingest queues the semantic tier)."""
    deadline = time.monotonic() + seconds
    while (waiting := _api(running, "/api/stats")["pending"]["semantic"]["sessions"]) > 0:
        assert time.monotonic() < deadline, f"{waiting} sessions still wait to be embedded after {seconds} s"
        time.sleep(0.2)


def _archived(running, conversation: str, check, seconds: float = 30) -> dict:
    """The conversation once the archive's answer for it passes ``check`` (the server archives an
    exchange a few seconds after its reply)."""
    deadline = time.monotonic() + seconds
    while True:
        with running.http(Authorization=f"Bearer {KEY}") as client:
            response = client.get(f"/api/conversations/{conversation}")
        if response.status_code == 200 and check(body := response.json()):
            return body
        assert time.monotonic() < deadline, (
            f"conversation {conversation} not archived as expected after {seconds} s: {response.text}"
        )
        time.sleep(0.1)


def _open(page, conversation: str) -> None:
    _show_list(page)
    page.locator(f'[data-testid=conversation][data-conversation-id="{conversation}"]').click()
    expect(page.locator("#chat")).to_have_attribute("data-conversation-id", conversation)


def _shown(turns: list) -> list:
    """The turns the page shows of a version: all but an empty system turn."""
    return [t for t in turns if t["role"] != "system" or t["text"].strip()]


# the menu's chosen option fits it: its text, in the menu's font, narrower than the menu less its arrow
WHOLE_OPTION = """() => {
  const menu = document.getElementById("version");
  const pen = document.createElement("canvas").getContext("2d");
  pen.font = getComputedStyle(menu).font;
  return pen.measureText(menu.selectedOptions[0].text).width + 32 <= menu.clientWidth;
}"""


def _slow_searches(page) -> None:
    """Searches answered a second late, as a large archive's are: the page must say it is searching."""
    page.evaluate(
        """() => {
      const fetched = window.fetch;
      window.fetch = (path, init) =>
        String(path).startsWith("/api/search") """
        """? new Promise((done) => setTimeout(() => done(fetched(path, init)), 1000)) : fetched(path, init);
    }"""
    )


def _turn_roles(page) -> list:
    return [t.get_attribute("data-role") for t in page.get_by_test_id("turn").all()]


def test_the_key_field_is_sent_and_kept(browser, running):
    context, errors = _context(browser, 1280, 860)
    page = context.new_page()
    page.goto(running.url)
    expect(page.locator("#status")).to_contain_text("401: this server needs an API key")
    assert page.get_by_test_id("conversation").count() == 0

    page.fill("#api-key", "wrong")
    page.click("#key-form button")
    expect(page.locator("#status")).to_contain_text("401: incorrect API key")

    page.fill("#api-key", KEY)
    page.click("#key-form button")
    expect(page.get_by_test_id("conversation")).to_have_count(2)
    expect(page.locator("#status")).to_be_empty()
    page.reload()  # the key stays in the profile's localStorage
    expect(page.get_by_test_id("conversation")).to_have_count(2)
    assert page.input_value("#api-key") == KEY
    context.close()
    assert errors == []


def test_listed_recent_first_and_markup_shown_as_text(page, running, axe):
    listed = _api(running, "/api/conversations")["conversations"]
    shown = page.get_by_test_id("conversation")
    assert [s.get_attribute("data-conversation-id") for s in shown.all()] == [c["conversation_id"] for c in listed]
    assert shown.locator(".name").all_text_contents() == [c["title"] for c in listed]
    _no_horizontal_scroll(page)
    _check_axe(axe, page)

    markup = next(c for c in listed if "markup" in (c["title"], c["name"]))
    _open(page, markup["conversation_id"])
    view = _api(running, f"/api/sessions/{markup['session_id']}")
    assert _turn_roles(page) == [t["role"] or "text" for t in _shown(view["turns"])] == ["user", "assistant"]
    turns = page.get_by_test_id("turn")
    assert HOSTILE in turns.first.text_content() and "<script>" in page.text_content("#turns")
    assert page.evaluate("window.__pwned") is None
    assert page.locator("main script, main b").count() == 0
    assert "<|im_" not in page.text_content("#turns")
    _no_horizontal_scroll(page)
    _check_axe(axe, page)


def test_the_list_comes_a_page_at_a_time(page, running):
    """A whole history's conversations are asked for a page at a time: here pages of 1 (the
    page's own asks rewritten), each further one on "Show more", until the filters admit no more."""
    listed = [c["conversation_id"] for c in _api(running, "/api/conversations")["conversations"]]
    assert len(listed) >= 2
    page.route(
        "**/api/conversations?*", lambda route: route.continue_(url=route.request.url.replace("limit=100", "limit=1"))
    )
    page.evaluate("document.getElementById('filter-form').reset()")  # the list asked for again
    shown = page.get_by_test_id("conversation")
    more = page.locator("#more-conversations")
    for count in range(1, len(listed)):
        expect(shown).to_have_count(count)
        expect(more).to_have_text(f"Show {len(listed) - count} more of {len(listed) - count}")
        more.click()
    expect(shown).to_have_count(len(listed))
    expect(more).to_be_hidden()
    assert [s.get_attribute("data-conversation-id") for s in shown.all()] == listed


def test_chat_reload_search_continue_branch_rename_delete(page, running, axe):
    sent = _record(page)

    # a new chat of three turns: all the chat's messages each time, the conversation named by the first reply
    page.click("#new-chat")
    expect(page.locator("#prompt")).to_be_focused()
    asked, first, report = _say(page, sent, "Hello there, who keeps the lighthouse?")
    assert (
        asked["stream"] is True
        and asked["kvdb"] == {}
        and asked["messages"] == [{"role": "user", "content": "Hello there, who keeps the lighthouse?"}]
    )
    conversation = report["conversation_id"]
    assert conversation
    asked, second, _ = _say(page, sent, "And what does he write\nin the ledger?")
    assert asked["kvdb"] == {"conversation": conversation}
    assert [m["role"] for m in asked["messages"]] == ["user", "assistant", "user"] and asked["messages"][1][
        "content"
    ] == first
    asked, _, _ = _say(page, sent, "Thanks.")
    assert asked["kvdb"] == {"conversation": conversation} and len(asked["messages"]) == 5
    assert _turn_roles(page) == ["user", "assistant"] * 3
    _check_axe(axe, page)

    # a reload lists the chat, recent first, and reopens it with its turns
    archived = _archived(
        running,
        conversation,
        lambda c: c["n_tokens"] > 0 and len(_api(running, f"/api/sessions/{c['session_id']}")["turns"]) >= 6,
    )
    page.reload()
    _show_list(page)
    first_listed = page.get_by_test_id("conversation").first
    expect(first_listed).to_have_attribute("data-conversation-id", conversation)
    _open(page, conversation)
    view = _api(running, f"/api/sessions/{archived['session_id']}")
    expect(page.get_by_test_id("turn")).to_have_count(len(_shown(view["turns"])))
    assert _turn_roles(page) == [t["role"] or "text" for t in _shown(view["turns"])]
    assert page.locator("#chat-title").text_content() == archived["title"]

    # search by meaning, once the server has embedded what it archived (in its idle time: ingest queues it)
    _embedded(running)
    _show_list(page)
    _slow_searches(page)
    page.fill("#search-q", "zqxj vbkw zqxj")
    page.press("#search-q", "Enter")
    expect(page.locator("#search-state")).to_have_text("Searching…")  # at once, while the server looks
    expect(page.locator("#search-state")).to_have_text("No match for “zqxj vbkw zqxj”.")
    page.check("#search-meaning")
    page.fill("#search-q", "ships counted at night")
    page.press("#search-q", "Enter")
    hits = page.get_by_test_id("hit")
    hits.first.wait_for()
    found = _api(running, "/api/search", q="ships counted at night", k=10, semantic=1)["hits"]
    expect(hits).to_have_count(len(found))
    expect(page.locator("#search-state")).to_have_text(
        f"{len(found)} nearest conversation{'s' if len(found) != 1 else ''}"
    )
    assert hits.first.locator(".grade").text_content() == f"score {found[0]['score']:.3f}" + (
        ", weak" if found[0]["weak"] else ""
    )  # the API's score and mark
    _check_axe(axe, page)
    n, hit = next(
        (n, h) for n, h in enumerate(found) if h["conversation_id"] != conversation
    )  # another conversation than the chat
    hits.nth(n).get_by_test_id("hit-open").click()
    expect(page.locator("#chat")).to_have_attribute("data-conversation-id", hit["conversation_id"])
    expect(page.locator("#chat")).to_have_attribute("data-session-id", hit["session_id"])
    hit_view = _api(running, f"/api/sessions/{hit['session_id']}")
    holding = next(i for i, t in enumerate(_shown(hit_view["turns"])) if t["start"] <= hit["position"] < t["end"])
    marked = page.get_by_test_id("turn").nth(holding)
    expect(marked).to_have_class(re.compile(r"\bhit-turn\b"))
    expect(marked).to_be_in_viewport()

    # continuing it: the new message appended to the version the hit is in
    asked, _, report = _say(page, sent, "Which ships came in?")
    assert asked["kvdb"] == {"session": hit["session_id"], "conversation": hit["conversation_id"]}
    assert asked["messages"] == [{"role": "user", "content": "Which ships came in?"}]
    assert report["conversation_id"] == hit["conversation_id"]
    assert _turn_roles(page) == [t["role"] or "text" for t in _shown(hit_view["turns"])] + ["user", "assistant"]

    # a branch from the chat's first turn: the turns after it replaced, the branch sent from that turn's end
    _open(page, conversation)
    forks = page.get_by_test_id("fork")
    forks.first.click()
    expect(page.locator("#branch-banner")).to_be_visible()
    expect(page.locator("#branch-text")).to_contain_text("Branch from turn 1")
    expect(page.locator("#prompt")).to_be_focused()
    expect(page.get_by_test_id("turn")).to_have_count(1)
    _check_axe(axe, page)
    asked, _, report = _say(page, sent, "Tell me about the harbour instead.")
    assert asked["kvdb"] == {
        "session": archived["session_id"],
        "at": _shown(view["turns"])[0]["end"],
        "conversation": conversation,
    }
    assert asked["messages"] == [{"role": "user", "content": "Tell me about the harbour instead."}]
    assert _turn_roles(page) == ["user", "user", "assistant"]

    # after a reload the conversation offers its versions, the branch among them
    branched = _archived(running, conversation, lambda c: len(c["history"]) > len(archived["history"]))
    page.reload()
    _open(page, conversation)
    versions = page.locator("#version option")
    expect(versions).to_have_count(len(branched["history"]))
    assert any(v["branch_of"] for v in branched["history"])
    assert any("branch of" in t for t in versions.all_text_contents())
    for version in [v["session_id"] for v in branched["history"]]:  # each option whole in the menu, at each width
        page.select_option("#version", version)
        expect(page.locator("#chat")).to_have_attribute("data-session-id", version)
        assert page.evaluate(WHOLE_OPTION), page.locator("#version option:checked").text_content()
    expect(page.locator("#chat-meta")).to_contain_text(f"{len(branched['history'])} versions")
    _no_horizontal_scroll(page)
    _check_axe(axe, page)

    # rename, by keyboard alone: the button, the field, Enter
    page.focus("#rename")
    page.keyboard.press("Enter")
    expect(page.locator("#rename-input")).to_be_focused()
    page.keyboard.press("ControlOrMeta+a")
    page.keyboard.type("Lighthouse chat")
    page.keyboard.press("Enter")
    expect(page.locator("#chat-title")).to_have_text("Lighthouse chat")
    _show_list(page)
    expect(page.locator(f'[data-testid=conversation][data-conversation-id="{conversation}"] .name')).to_have_text(
        "Lighthouse chat"
    )
    assert _api(running, f"/api/conversations/{conversation}")["title"] == "Lighthouse chat"

    # delete, confirmed
    page.click("#delete")
    expect(page.locator("#delete-no")).to_be_focused()
    _check_axe(axe, page)
    page.click("#delete-yes")
    expect(page.locator(f'[data-testid=conversation][data-conversation-id="{conversation}"]')).to_have_count(0)
    assert conversation not in [c["conversation_id"] for c in _api(running, "/api/conversations")["conversations"]]
    expect(page.locator("#status")).to_contain_text("Deleted “Lighthouse chat”")
