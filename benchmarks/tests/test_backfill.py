"""The history benchmarks/backfill.py builds from the fixture logs: each copy a new conversation
(fresh ids, linked as before), its times moved, its project set, its text its own, and each
planted phrase whole in the file the ground truth names. No model, no tokenizer."""

import datetime as dt
import json
import random

import backfill as B


def _template(agent: str, prefix: str) -> B.Template:
    return next(t for t in B.load_templates((agent,)) if t.path.name.startswith(prefix))


def _uuids(records: list, key: str) -> set[str]:
    return {r[key] for r in records if isinstance(r, dict) and isinstance(r.get(key), str) and B.UUID.fullmatch(r[key])}


def test_a_copy_has_fresh_ids_linked_as_before_and_moved_times():
    t = _template("claude-code", "spotter-tool_heavy")
    pool = B.word_pool([t])
    shift = dt.timedelta(days=-40, hours=-3)
    one = B.Copy("copy1", t.keys, "/work/p1", shift, pool).records(t.records)
    two = B.Copy("copy2", t.keys, "/work/p1", shift, pool).records(t.records)
    old, new = _uuids(t.records, "uuid"), _uuids(one, "uuid")
    assert len(new) == len(old) and not new & old and not new & _uuids(two, "uuid")  # fresh, and per copy
    assert _uuids(one, "parentUuid") <= new  # every parent link still points into the copy
    assert len(_uuids(t.records, "parentUuid")) == len(_uuids(one, "parentUuid"))
    assert {r["sessionId"] for r in one if "sessionId" in r} == {
        B.fresh_uuid("copy1", s) for s in {r["sessionId"] for r in t.records if "sessionId" in r}
    }
    ids = [
        (a["message"]["id"], b["message"]["id"])
        for a, b in zip(t.records, one)
        if isinstance(a.get("message"), dict) and str(a["message"].get("id", "")).startswith("msg_")
    ]
    assert ids and all(n.startswith("msg_") and n != o and len(n) == len(o) for o, n in ids)
    assert all(r.get("cwd", "/work/p1") == "/work/p1" for r in one)
    first = next(i for i, r in enumerate(t.records) if "timestamp" in r)
    was, now = (dt.datetime.fromisoformat(r[first]["timestamp"].replace("Z", "+00:00")) for r in (t.records, one))
    assert now - was == dt.timedelta(days=-40, hours=-3)


def test_copies_say_different_words_and_keep_json_strings_valid():
    t = _template("codex-cli", "vct-rollout")
    pool = B.word_pool([t])
    a = B.text_fields(B.Copy("a", t.keys, "/p", dt.timedelta(0), pool).records(t.records), t.keys)
    b = B.text_fields(B.Copy("b", t.keys, "/p", dt.timedelta(0), pool).records(t.records), t.keys)
    assert a != b and len(a) == len(b)
    for original, copied in zip(t.texts, a):
        if B.is_json(original):
            assert copied == original  # tool arguments stay as the log wrote them
    text = "Please check the parser before merging it into main today"
    assert (
        B.mutate(text, random.Random(1), ["zebra"], rate=1.0)
        == "Zebra zebra the zebra zebra zebra it zebra zebra zebra"
    )
    # never after a backslash
    assert B.mutate("C:\\Users and \\ntext", random.Random(1), ["zebra"], rate=1.0) == "C:\\Users and \\ntext"
    assert B.mutate(text, random.Random(1), ["zebra"], rate=0.0) == text


def test_planted_phrases_stay_whole():
    rng = random.Random(3)
    text = "one two three four five"
    out = B.plant(text, ["Quartz Harbour Ledger 4417", "AMBER ANVIL QUIVER 2131", "cedar fjord oriole 1000"], rng)
    for phrase in ("Quartz Harbour Ledger 4417", "AMBER ANVIL QUIVER 2131", "cedar fjord oriole 1000"):
        assert out.count(phrase) == 1
    assert B.plant("", ["x y 1"], rng) == " x y 1"
    assert B.phrase_cased("quartz harbour ledger 4417", "sentence") == "Quartz harbour ledger 4417"


def test_build_history_plants_each_phrase_in_the_file_it_names(tmp_path):
    templates = B.load_templates(("claude-code", "gemini-cli", "chatgpt"))
    for t in templates:
        t.tokens = sum(len(s.split()) for s in t.texts)  # words stand in for tokens
    pool = B.word_pool(templates)
    phrases = B.make_phrases(12, random.Random(0))
    planted, counts = B.build_history(
        tmp_path, templates, pool, 2 * sum(t.tokens for t in templates), phrases, 4, random.Random(0)
    )
    assert counts["files"] >= 2 * len(templates) and counts["projects"] <= 4
    assert sorted(p.phrase for p in planted) == sorted(phrases)
    for p in planted:
        body = open(p.file, encoding="utf-8").read()
        assert p.text in body and p.text.lower() == p.phrase
        assert p.file.startswith(p.project + "/")
    files = B.history_files(tmp_path)
    assert len(files) == counts["files"]
    claude = [path for path, _, _ in files if path.parent.name == "claude-code" and "tool_heavy" in path.name]
    for path in claude:
        cwds = {json.loads(line).get("cwd") for line in path.read_text().splitlines()} - {None}
        assert cwds == {str(path.parent.parent)}
