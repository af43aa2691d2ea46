"""Chat messages to the text a model sees: its chat template, with nothing added that the
transcript does not hold (decision 0018).

- A template that writes a default system prompt when the conversation has none (SmolLM2's
  "You are a helpful AI assistant named SmolLM…", Qwen's) is given an empty system turn
  instead, so the archive holds the template's markup but not words nobody wrote.
- Tool calls and results go through the template when it renders them (it mentions
  ``tool_calls``); otherwise, and for what no template renders (a speaker's ``name``, an error
  flag, reasoning), they become text in the message, as ``TEXTUAL`` shows.
- Without a template, a turn is ``role: content`` and a blank line.
"""

from __future__ import annotations

import json
import os
import re
import weakref

import numpy as np

from kvdb.model import tokenizer as tok
from kvdb.model.tokenizer import LightTokenizer

TEXTUAL = {
    "name": "{name}: {content}",
    "thinking": "<thinking>\n{thinking}\n</thinking>\n{content}",
    "tool_call": "<tool_call id={id} name={name}>{arguments}</tool_call>",
    "tool_result": "<tool_result id={id} name={name}{error}>\n{content}\n</tool_result>",
}
_PROBE = "\u2063kvdb probe\u2063"
_DEFAULT_SYSTEM: dict[str, bool] = {}  # template source -> whether it writes a system prompt of its own
# tokenizer -> how its turns open, as its own ids (see turns)
_TURN_MARKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# tokenizer -> the markup around a turn's content (see turn_content)
_TURN_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HISTORY = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})
ROLE_TOKENS = 32  # tokens after a turn's opening that hold its role word (byte-level tokenizers: one a byte)


def render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    """Messages as the model saw them in training, under the rules above."""
    if isinstance(tokenizer, LightTokenizer):
        raise TypeError(
            f"rendering messages needs transformers' tokenizer (model.load(), tokenizer.load_full()), not {tokenizer!r}"
        )
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        turns = [_textual(m) for m in messages]
        return "".join(f"{m['role']}: {m['content']}\n\n" for m in turns) + (
            "assistant: " if add_generation_prompt else ""
        )
    native_tools = "tool_calls" in str(template)
    turns = [_for_template(m, native_tools) for m in messages]
    if (not turns or turns[0]["role"] != "system") and writes_default_system(tokenizer):
        turns.insert(0, {"role": "system", "content": ""})
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)


def user_turn_suffix(tokenizer, prompt: str) -> str:
    """The text a chat template appends for one more user turn and the assistant's reply header."""
    return turns_suffix(tokenizer, [{"role": "user", "content": prompt}])


def turns_suffix(tokenizer, messages, add_generation_prompt: bool = True) -> str:
    """The text a chat template appends for more turns (normalised messages) after a finished
    conversation, and the assistant's reply header when ``add_generation_prompt``.

    Found by rendering a conversation with and without them: templates only add text at the
    end (one that does otherwise gets the turns' contents)."""
    appended = _appended(tokenizer, list(_HISTORY), list(messages), add_generation_prompt)
    return appended if appended is not None else "".join(m["content"] for m in messages)


def turns(tokenizer, ids: np.ndarray) -> list[tuple[str | None, int, int]]:
    """(role, start, end) of each turn in a session's token ids, cut where the template opens a
    turn. What comes before the first opening, all of a text session, is one turn of no role."""
    markers = _turn_markers(tokenizer)
    ids = np.asarray(ids, dtype=np.int64)
    opens = turn_opens(tokenizer, ids)
    starts = opens if opens.size and opens[0] == 0 else np.concatenate([[0], opens]).astype(np.int64)
    ends = np.append(starts[1:], len(ids))
    opened, out = set(opens.tolist()), []
    for start, end in zip(starts.tolist(), ends.tolist()):  # a few turns per session, not tokens
        role = None
        if start in opened:
            assert markers is not None  # turns open only where markers were found
            head = tok.decode(tokenizer, ids[start + len(markers[0]) : min(end, start + len(markers[0]) + ROLE_TOKENS)])
            word = re.match(r"\s*(\w+)", head)
            role = markers[1].get(word[1], word[1]) if word else None
        out.append((role, start, end))
    return out


def turn_opens(tokenizer, ids: np.ndarray) -> np.ndarray:
    """The positions in ``ids`` where the template opens a turn (none without a template)."""
    markers = _turn_markers(tokenizer)
    ids = np.asarray(ids, dtype=np.int64)
    if markers is None or len(ids) < len(markers[0]):
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(ids, len(markers[0]))
    return np.flatnonzero((windows == markers[0]).all(axis=1)).astype(np.int64)


def writes_default_system(tokenizer) -> bool:
    """Whether the template puts text before the first user turn when there is no system turn,
    more than it does around an empty system turn: that text is a default system prompt."""
    template = str(tokenizer.chat_template)
    if template not in _DEFAULT_SYSTEM:
        try:
            bare = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
            blank = tokenizer.apply_chat_template(
                [{"role": "system", "content": ""}, {"role": "user", "content": _PROBE}], tokenize=False
            )
            _DEFAULT_SYSTEM[template] = bare.find(_PROBE) > blank.find(_PROBE) >= 0
        except Exception:  # noqa: BLE001 - a template that refuses a system turn has no default to replace
            _DEFAULT_SYSTEM[template] = False
    return _DEFAULT_SYSTEM[template]


def _for_template(message: dict, native_tools: bool) -> dict:
    if not native_tools or not (message.get("tool_calls") or message["role"] == "tool"):
        return _textual(message)
    if message["role"] == "tool":
        turn = {"role": "tool", "content": ("[error] " if message.get("is_error") else "") + message["content"]}
        return turn | {k: message[k] for k in ("tool_call_id", "name") if k in message}
    turn = _textual({k: v for k, v in message.items() if k != "tool_calls"})
    turn["tool_calls"] = [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": _arguments(call["arguments"])},
        }
        for call in message["tool_calls"]
    ]
    return turn


def _textual(message: dict) -> dict:
    """``{"role", "content"}`` with the rest of the message written into the content."""
    content = message["content"]
    if message["role"] == "tool":
        error = " error=true" if message.get("is_error") else ""
        content = TEXTUAL["tool_result"].format(
            id=_attribute(message.get("tool_call_id")),
            name=_attribute(message.get("name")),
            error=error,
            content=content,
        )
    elif message.get("name"):
        content = TEXTUAL["name"].format(name=message["name"], content=content)
    calls = [
        TEXTUAL["tool_call"].format(id=_attribute(c["id"]), name=_attribute(c["name"]), arguments=c["arguments"])
        for c in message.get("tool_calls", ())
    ]
    if calls:
        content = "\n".join(([content] if content else []) + calls)
    if message.get("thinking"):
        content = TEXTUAL["thinking"].format(thinking=message["thinking"], content=content)
    return {"role": message["role"], "content": content}


def _attribute(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments(text: str):
    """Templates expect a call's arguments as an object (they serialise it themselves); text that
    is not a JSON object stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _appended(tokenizer, history: list[dict], messages: list[dict], add_generation_prompt: bool = False) -> str | None:
    """What rendering ``messages`` after ``history`` adds at the end, or None if it changes the history's text."""
    before = render(tokenizer, history)
    after = render(tokenizer, history + messages, add_generation_prompt=add_generation_prompt)
    return after[len(before) :] if after.startswith(before) else None


def _turn_markers(tokenizer) -> tuple[np.ndarray, dict[str, str]] | None:
    """(the token ids that open every turn, the template's word for each role -> the role), or
    None where turns open with no text of their own (no template, or one like ``[INST]``)."""
    if tokenizer not in _TURN_MARKERS:
        _TURN_MARKERS[tokenizer] = _find_turn_markers(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    return _TURN_MARKERS[tokenizer]


def turn_content(tokenizer, text: str) -> str:
    """A turn's text (``turns``) without the template's markup around what was said: the
    opening, the role word and what follows it (``<|im_start|>user\\n``), and the closing
    (``<|im_end|>\\n``). Text the template did not frame is given back whole."""
    frame = _turn_frame(tokenizer)
    if frame is None:
        return text
    opening, after_role, closing = frame
    head = re.match(re.escape(opening) + r"\w+" + re.escape(after_role), text)
    if head is not None:
        text = text[head.end() :]
    for end in (closing, closing.rstrip()):
        if end and text.endswith(end):
            return text[: -len(end)]
    return text


def ends_turn(tokenizer, ids: np.ndarray) -> bool:
    """Whether ``ids`` end where the template closes a turn (``<|im_end|>\\n``)."""
    frame = _turn_frame(tokenizer)
    if frame is None or not len(ids):
        return False
    tail = tok.decode(tokenizer, np.asarray(ids)[-ROLE_TOKENS:])
    return any(end and tail.endswith(end) for end in (frame[2], frame[2].rstrip()))


def _turn_frame(tokenizer) -> tuple[str, str, str] | None:
    if tokenizer not in _TURN_FRAMES:
        _TURN_FRAMES[tokenizer] = _find_turn_frame(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    return _TURN_FRAMES[tokenizer]


def _rendered_turns(tokenizer) -> tuple[dict[str, str], str] | None:
    """(role -> the text a user or assistant turn's header renders as, before what was said;
    the text the user turn closes with), or None where the template frames no turns."""
    probe = {"content": _PROBE}
    try:
        rendered = {
            "user": _appended(tokenizer, list(_HISTORY), [{"role": "user"} | probe]),
            "assistant": _appended(tokenizer, [{"role": "user", "content": "x"}], [{"role": "assistant"} | probe]),
        }
    except Exception:  # noqa: BLE001 - a template that refuses these turns has no turns kvdb can cut
        return None
    heads = {role: head[: head.find(_PROBE)] for role, head in rendered.items() if head and _PROBE in head}
    if len(heads) < 2:
        return None
    user = rendered["user"]
    assert user is not None  # a head was found in it
    return heads, user[user.find(_PROBE) + len(_PROBE) :]


def _opening(heads: dict[str, str]) -> str:
    """What the turn headers share before their role word (ChatML's ``<|im_start|>``)."""
    opening = os.path.commonprefix(list(heads.values()))
    role_word = re.search(r"\w*$", opening)
    assert role_word is not None  # it matches, if only the empty string at the end
    return opening[: len(opening) - len(role_word[0])]  # the role word is not part of it


def _find_turn_frame(tokenizer) -> tuple[str, str, str] | None:
    """(the opening, what follows the role word in a header, the closing) of the template's turns."""
    found = _rendered_turns(tokenizer)
    if found is None:
        return None
    heads, closing = found
    opening = _opening(heads)
    after_role = re.sub(r"^\w+", "", heads["user"][len(opening) :])
    return (opening, after_role, closing) if opening.strip() else None


def _find_turn_markers(tokenizer) -> tuple[np.ndarray, dict[str, str]] | None:
    """The opening is what the user and the assistant turn headers share before their role word
    (ChatML's ``<|im_start|>``, Gemma's ``<start_of_turn>``); the word after it names the role."""
    found = _rendered_turns(tokenizer)
    if found is None:
        return None
    heads, _ = found
    opening = _opening(heads)
    ids = np.asarray(tok.encode(tokenizer, opening), dtype=np.int64) if opening.strip() else np.zeros(0, dtype=np.int64)
    if not ids.size or any(tok.encode(tokenizer, head)[: ids.size] != ids.tolist() for head in heads.values()):
        return None
    roles = {}
    for role, head in heads.items():
        word = re.match(r"\s*(\w+)", head[len(opening) :])
        if word:
            roles[word[1]] = role
    return ids, roles
