"""A session's title and dates come from its file: an export's title, an agent's summary, else the
first thing the user typed (never a bare id), and the times the export or log records, not when
kvdb read it (kvdb.transcripts.sessions.first_prompt, kvdb.transcripts.stamps.said; decision 0052)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from support import write, write_jsonl

from kvdb.transcripts import read_transcripts
from kvdb.transcripts.redaction import redacted
from kvdb.transcripts.sessions import TITLE_CHARS, UNTITLED, first_prompt, shortened
from kvdb.transcripts.stamps import instant

EXPORTS = Path(__file__).parents[1] / "fixtures" / "exports"


def title(session) -> str:
    """What lists show (``kvdb.records.Session.title``)."""
    return session.metadata.get("title") or session.name


def utc(value) -> str:
    """An export's time as the metadata writes it: naive UTC, ISO 8601."""
    if isinstance(value, (int, float)):
        return (
            dt.datetime.fromtimestamp(value / 1000 if value > 1e11 else value, dt.UTC).replace(tzinfo=None).isoformat()
        )
    return dt.datetime.fromisoformat(value).astimezone(dt.UTC).replace(tzinfo=None).isoformat()


def dates(session) -> tuple[str | None, str | None]:
    return session.metadata.get("started"), session.metadata.get("ended")


# the rule ---------------------------------------------------------------------------------


def test_a_prompt_is_shortened_on_a_word_boundary_with_an_ellipsis():
    words = "Why does the harbour master read the ledger every morning before the ships come in at dawn?"
    short = shortened(words)
    assert (
        len(short) <= TITLE_CHARS
        and short.endswith("…")
        and words.startswith(short[:-1])
        and words[len(short) - 1] == " "
    )
    assert shortened("a  short\n\nprompt ") == "a short prompt"  # one line, as it was typed
    chinese = "專案經過了多輪跌代可能會產生為了向後兼容產生的代碼" * 4  # no space to cut at: cut where the limit falls
    assert shortened(chinese) == chinese[: TITLE_CHARS - 1] + "…"


def test_the_first_prompt_passes_over_what_the_harness_wrote():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"},
        {
            "role": "user",
            "content": "[image not archived]\n<system-reminder>Files changed.</system-reminder>\nFix the flaky test",
        },
    ]
    assert first_prompt(messages) == "Fix the flaky test"
    assert (
        first_prompt([{"role": "user", "content": "Caveat: generated"}, messages[2]], ("Caveat:",))
        == "Fix the flaky test"
    )
    assert first_prompt([{"role": "user", "content": "<div>a</div> renders blank"}]) == "renders blank"
    assert (
        first_prompt([{"role": "user", "content": ""}, {"role": "assistant", "content": "Here is the plan."}])
        == "Here is the plan."
    )
    assert first_prompt([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]) == UNTITLED


def test_times_are_read_in_every_shape_an_export_writes():
    expected = dt.datetime(2025, 6, 21, 20, 24, 42)
    assert (
        instant(1750537482)
        == instant(1750537482000)
        == instant("2025-06-21T20:24:42Z")
        == instant("2025-06-21T22:24:42+02:00")
        == expected
    )
    assert instant({"$date": {"$numberLong": "1750537482000"}}) == expected  # Grok's MongoDB dump
    assert [instant(v) for v in ("", "soon", None, True, [1], float("nan"))] == [None] * 6


# agent logs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("claude-code/spotter-short.jsonl", "mix phx.server doesnt seem to start"),
        ("claude-code/spotter-tool_heavy.jsonl", "start phoenix in background"),
        # the compaction's summary, the local command's caveat and the /compact command are Claude Code's,
        # not the user's
        ("claude-code/spotter-ae4a77f8-lines1456-1500-compaction.jsonl", "continue implementation"),
        ("codex-cli/synthetic-legacy-rollout-2025-05.jsonl", "SYNTHETIC: list the files in this directory"),
        # <environment_context> passed over; the IDE extension's context before "## My request for Codex:" too
        (
            "codex-cli/vct-rollout-2025-09-19-codex_vscode-0.39.0.jsonl",
            "幫我檢查一下 go.mod 裡面 為何 go版本是 1.24? 請幫我統一成 1.24 並且我希望 1.24 以上就能使用 並將…",
        ),
        ("gemini-cli/agent-sessions-stage0-gemini-jsonl_v040.jsonl", "Say hello and list files."),
        (
            "gemini-cli/vct-legacy-session-2026-03-27-cut.json",
            "請幫我依照專案實際狀況更新 README.md README.zh-CN.md README.zh-TW.md, 開發者的引導不需要寫在裡面…",
        ),
        ("gemini-cli/synthetic-restore-checkpoint.json", "SYNTHETIC: change the title in README.md"),
    ],
)
def test_an_agent_log_is_titled_by_its_first_prompt_not_its_id(fixture, expected):
    session = read_transcripts(EXPORTS / fixture)[0]
    assert title(session) == expected and len(expected) <= TITLE_CHARS
    assert session.name != expected  # the id (or the file's name) still names it for references


def test_a_sub_agent_is_titled_by_its_task_and_a_branch_keeps_its_number():
    main, agent = read_transcripts(EXPORTS / "claude-code" / "spotter-ae4a77f8-lines65-101-task-subagent.jsonl")
    assert title(agent).startswith("Search hex.pm for the latest versions of these Elixir packages") and title(
        agent
    ).endswith("…")
    assert (
        title(main) == "Now let me check available versions and look up the setup APIs."
    )  # a cut with no prompt: the reply's first words
    first, branch = read_transcripts(EXPORTS / "claude-code" / "spotter-ae4a77f8-lines1456-1500-compaction.jsonl")
    assert branch.name.endswith(" [branch 2]") and title(branch).endswith("… [branch 2]")
    windows = read_transcripts(
        EXPORTS / "codex-cli" / "agent-sessions-stage0-codex-small.jsonl"
    )  # its thread was named
    assert [title(w) for w in windows[:3]] == [
        "[trimmed for fixture]",
        "[trimmed for fixture] [window 2]",
        "[trimmed for fixture] [window 3]",
    ]


def test_a_codex_prompt_sent_in_one_turn_with_the_project_s_instructions_is_its_title(tmp_path):
    parts = [
        "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>",
        "# AGENTS.md instructions for /repo\n\n<INSTRUCTIONS>\nUse pytest.\n</INSTRUCTIONS>",
    ]
    turn = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": t} for t in [*parts, "Why Postgres for the shop?"]],
    }
    lines = [
        {
            "timestamp": "2026-03-08T09:58:46Z",
            "type": "session_meta",
            "payload": {"id": "019fc8be-3658-7ca3-9e29-00000000000c", "cwd": "/repo"},
        },
        {"timestamp": "2026-03-08T09:58:47Z", "type": "response_item", "payload": turn},
    ]
    [session] = read_transcripts(
        write_jsonl(tmp_path / "rollout-2026-03-08T09-58-46-019fc8be-3658-7ca3-9e29-00000000000c.jsonl", lines)
    )
    assert session.name == "019fc8be-3658-7ca3-9e29-00000000000c" and title(session) == "Why Postgres for the shop?"
    assert dates(session) == ("2026-03-08T09:58:46", "2026-03-08T09:58:47")


def claude_event(uuid, parent, text, **more):
    return {
        "type": "user",
        "uuid": uuid,
        "parentUuid": parent,
        "sessionId": "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e",
        "message": {"role": "user", "content": text},
    } | more


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([], "Rename the harbour module"),
        (
            [
                {
                    "type": "ai-title",
                    "aiTitle": "Harbour module rename",
                    "sessionId": "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e",
                }
            ],
            "Harbour module rename",
        ),
        ([{"type": "summary", "summary": "Renaming the harbour", "leafUuid": "u2"}], "Renaming the harbour"),
        (
            [
                {"type": "summary", "summary": "Renaming the harbour", "leafUuid": "u2"},
                {
                    "type": "ai-title",
                    "aiTitle": "Harbour module rename",
                    "sessionId": "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e",
                },
                {"type": "custom-title", "customTitle": "Harbour", "sessionId": "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e"},
            ],
            "Harbour",
        ),
    ],
)
def test_a_claude_code_title_is_the_user_s_then_the_summary_then_the_generated_one_then_the_prompt(
    tmp_path, records, expected
):
    log = [
        claude_event(
            "u0", None, "<command-name>/clear</command-name><command-message>clear</command-message>", isMeta=True
        ),
        claude_event("u1", "u0", "Rename the harbour module"),
        {
            "type": "assistant",
            "uuid": "u2",
            "parentUuid": "u1",
            "sessionId": "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e",
            "message": {"role": "assistant", "content": "Done."},
        },
        *records,
    ]
    [session] = read_transcripts(write_jsonl(tmp_path / "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e.jsonl", log))
    assert title(session) == expected and session.name in (
        "0199aa7e-1c4f-7b2a-9d3e-5f6a7b8c9d0e",
        "Renaming the harbour",
    )


def test_a_gemini_checkpoint_keeps_its_tag_and_logs_json_titles_each_session():
    [checkpoint] = read_transcripts(
        EXPORTS / "gemini-cli" / "synthetic-checkpoint-tag.json"
    )  # /chat save TAG: the file is named by the user
    assert "title" not in checkpoint.metadata and title(checkpoint) == "synthetic-checkpoint-tag"
    first, second = read_transcripts(EXPORTS / "gemini-cli" / "synthetic-logs.json")
    assert (title(first), title(second)) == (
        "SYNTHETIC: read README.md and summarise it",
        "SYNTHETIC: first prompt of a second session",
    )


# exports ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "path", "keys"),
    [
        ("chatgpt/openwebui-importer-gpt_example.json", [0], ("create_time", "update_time")),
        ("chatgpt/synthetic-chatgpt-reasoning-tools-branch.json", [0], ("create_time", "update_time")),
        ("claude-ai/simonw-claude-to-sqlite-example.json", [0], ("created_at", "updated_at")),
        ("claude-ai/openwebui-importer-claude_tooluse_example.json", [0], ("created_at", "updated_at")),
        ("open-webui/synthetic-openwebui-export.json", [0], ("created_at", "updated_at")),
        (
            "grok/openwebui-importer-grok_example.json",
            ["conversations", 0, "conversation"],
            ("create_time", "modify_time"),
        ),
        ("grok/polylogue-grok-native-bundle.json", ["conversation"], ("createTime", "modifyTime")),
        ("ai-studio/polylogue-code_execution_session.json", [], ("createTime", "updateTime")),
    ],
)
def test_an_export_s_conversation_was_said_when_the_export_says(fixture, path, keys):
    """The conversation's own start and last update, whichever day the export is ingested; its
    title is the app's, kept as the name (no ``title`` of its own)."""
    head = json.loads((EXPORTS / fixture).read_text(encoding="utf-8"))
    for key in path:
        head = head[key]
    sessions = read_transcripts(EXPORTS / fixture)
    assert all(dates(s) == (utc(head[keys[0]]), utc(head[keys[1]])) for s in sessions)
    assert "title" not in sessions[0].metadata and sessions[0].name == (
        head.get("title") or head.get("name") or head.get("displayName")
    )


def test_chat_app_logs_without_a_conversation_time_take_their_messages():
    chat = json.loads((EXPORTS / "open-webui" / "openwebui-importer-webui-json.json").read_text(encoding="utf-8"))
    [session] = read_transcripts(EXPORTS / "open-webui" / "openwebui-importer-webui-json.json")
    stamps = [chat["timestamp"], *(m["timestamp"] for m in chat["history"]["messages"].values())]
    assert dates(session) == (
        utc(min(s / 1000 if s > 1e11 else s for s in stamps)),
        utc(max(s / 1000 if s > 1e11 else s for s in stamps)),
    )
    [modern] = read_transcripts(
        EXPORTS / "sillytavern" / "synthetic-modern-chat.jsonl"
    )  # create_date "2025-03-01@10h15m02s", then ISO send_dates
    lines = [
        json.loads(line)
        for line in (EXPORTS / "sillytavern" / "synthetic-modern-chat.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert dates(modern) == (
        "2025-03-01T10:15:02",
        max(utc(line["send_date"]) for line in lines[1:] if "send_date" in line),
    )
    assert title(modern) == "synthetic-modern-chat"  # the file's name is the app's name for the chat
    [legacy] = read_transcripts(EXPORTS / "sillytavern" / "synthetic-legacy-2023-chat.jsonl")  # milliseconds
    assert dates(legacy)[0] == utc(1673181146000) and dates(legacy)[1] > dates(legacy)[0]


def test_an_untitled_export_is_titled_by_its_first_prompt(tmp_path):
    gpt = json.loads(
        (EXPORTS / "chatgpt" / "synthetic-chatgpt-reasoning-tools-branch.json").read_text(encoding="utf-8")
    )
    gpt[0]["title"] = None  # a conversation ChatGPT has not named yet: its id would name it
    current, other = read_transcripts(write(tmp_path / "conversations.json", json.dumps(gpt)))
    assert current.name == gpt[0]["conversation_id"]
    assert title(current).startswith(
        "SYNTHETIC edited version of the question"
    )  # past the custom instructions sent in the user's name
    assert title(other).startswith("SYNTHETIC first version of the question") and title(other).endswith(
        "… [branch 2]"
    )  # the branch's own prompt
    claude = json.loads((EXPORTS / "claude-ai" / "simonw-claude-to-sqlite-example.json").read_text(encoding="utf-8"))
    claude[0]["name"] = ""
    claude[0]["chat_messages"][0]["attachments"] = [
        {"file_name": "notes.txt", "extracted_content": "A long document the model read first."}
    ]
    [session] = read_transcripts(write(tmp_path / "claude.json", json.dumps(claude)))
    assert (
        session.name == claude[0]["uuid"] and title(session) == "Turn this into a bash command"
    )  # the prompt, not the document
    cut = read_transcripts(
        EXPORTS / "claude-ai" / "openwebui-importer-claude_example.cut.json"
    )  # unnamed, and its text cut out
    assert [title(s) for s in cut] == [UNTITLED] * 4 + ["How Photosynthesis Works"]
    webui = {"title": "New Chat", "chat": {"history": {"currentId": "b", "messages": {
        "a": {"id": "a", "parentId": None, "role": "user", "content": "Plan the harbour tour", "timestamp": 1740823000},
        "b": {"id": "b", "parentId": "a", "role": "assistant", "content": "Start at the lighthouse.",
              "timestamp": 1740823060},
    }}}}  # fmt: skip
    [chat] = read_transcripts(write(tmp_path / "webui.json", json.dumps(webui)))
    assert title(chat) == "Plan the harbour tour" and dates(chat) == (utc(1740823000), utc(1740823060))
    studio = json.loads(
        (EXPORTS / "ai-studio" / "openwebui-importer-aistudio_example.json").read_text(encoding="utf-8")
    )
    [prompt] = read_transcripts(
        write(tmp_path / "Untitled prompt (3).json", json.dumps(studio))
    )  # Drive's name for one not named
    assert prompt.name == "Untitled prompt (3)" and title(prompt).startswith("in diceter asyclic graphical models")
    [named] = read_transcripts(EXPORTS / "ai-studio" / "openwebui-importer-aistudio_example.json")
    assert "title" not in named.metadata and dates(named) == (None, None)  # AI Studio's own files keep no times


def test_a_dataset_row_named_by_its_place_or_id_is_titled_by_its_prompt(tmp_path):
    rows = [
        {
            "id": "33f01939a744455c869cb234afca47f1",
            "conversation": [{"role": "user", "content": "What is a lighthouse?"}],
            "model": "m",
        }
    ]
    lmsys, _ = read_transcripts(write_jsonl(tmp_path / "lmsys.jsonl", rows * 2))
    assert lmsys.name == "33f01939a744455c869cb234afca47f1" and title(lmsys) == "What is a lighthouse?"
    [whole] = read_transcripts(write(tmp_path / "harbour.json", json.dumps({"messages": rows[0]["conversation"]})))
    assert title(whole) == "harbour"  # a file of one session is called what the user named it


def test_a_redacted_session_s_title_holds_no_secret_even_cut_inside_one(tmp_path):
    key = "sk-proj-" + "A1b2C3d4" * 10
    pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIE" + "q" * 100 + "\n-----END RSA PRIVATE KEY-----"
    for prompt in (
        f"Why does {key} fail?",
        f"Use {key}",
        f"Here: {pem}",
    ):  # whole; cut inside a key; cut inside a block no pattern matches
        log = [
            {
                "type": "user",
                "uuid": "u1",
                "parentUuid": None,
                "sessionId": "s1",
                "message": {"role": "user", "content": prompt},
            }
        ]
        [session] = read_transcripts(write_jsonl(tmp_path / "s1.jsonl", log))
        clean = redacted(session)
        assert (
            "A1b2" not in clean.metadata["title"]
            and "MIIE" not in clean.metadata["title"]
            and "[secret not archived]" in clean.metadata["title"]
        )
        assert clean.dropped == {"secret": 1}  # counted once, in the turn
