"""`--redact`: secrets of known shapes never reach the archive; each is a placeholder, counted
as the other placeholders are. Opt in: without it, the text is archived as it is."""

from __future__ import annotations

from support import write_jsonl

from kvdb.transcripts.redaction import redacted
from kvdb.transcripts.sessions import Transcript

OPENAI = "sk-proj-" + "a1B2c3D4e5F6g7H8i9J0" * 2
GITHUB = "ghp_" + "A" * 36
AWS = "AKIA" + "ABCDEFGHIJKLMNOP"
KEY_BLOCK = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nabc\n-----END RSA PRIVATE KEY-----"


def test_every_known_shape_is_replaced_and_counted_wherever_it_is():
    transcript = Transcript(
        "t",
        "t.jsonl",
        None,
        (
            {"role": "user", "content": f"my key is {OPENAI}, and {AWS}"},
            {
                "role": "assistant",
                "content": "Let me use it.",
                "tool_calls": [{"id": "1", "name": "Bash", "arguments": f'{{"cmd": "gh auth {GITHUB}"}}'}],
            },
            {"role": "tool", "content": f"Authorization: Bearer {'x' * 24}\n{KEY_BLOCK}", "tool_call_id": "1"},
        ),
        {"side": {"events": [{"type": "hook", "text": f"token {GITHUB}"}]}},
        {"image": 1},
    )
    clean = redacted(transcript)
    flat = repr(clean)
    assert not any(secret in flat for secret in (OPENAI, GITHUB, AWS, "MIIEowIBAAKCAQEA", "x" * 24))
    assert clean.dropped == {"image": 1, "secret": 6} and flat.count("[secret not archived]") == 6
    assert clean.messages[0]["content"] == "my key is [secret not archived], and [secret not archived]"
    assert (
        redacted(Transcript("t", "t.txt", "sk-short and a plain sentence", None, {})).dropped == {}
    )  # too short to be a key


def test_ingest_redacts_only_when_asked(archive, tmp_path):
    talk = [{"role": "user", "content": f"Deploy with {OPENAI} please."}, {"role": "assistant", "content": "Deployed."}]
    [kept] = archive.ingest(write_jsonl(tmp_path / "a" / "talk.jsonl", talk))
    assert OPENAI in archive.text(kept.session_id) and kept.dropped == {}
    [clean] = archive.ingest(write_jsonl(tmp_path / "b" / "talk.jsonl", talk), redact=True)
    assert clean.dropped == {"secret": 1} and clean.to_dict()["dropped"] == {"secret": 1}
    text = archive.text(clean.session_id)
    assert OPENAI not in text and "Deploy with [secret not archived] please." in text
