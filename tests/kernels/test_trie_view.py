"""A search's view of the trie: which session a hit on a node is reported in, computed for every
node at once (``trie.owners``), against the rule walked session by session."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvdb.index import trie


@st.composite
def tries(draw):
    """A forest of nodes (each parent before its child; -1 at a root), and sessions oldest first,
    each with its leaf (-1: a session whose leaf holds no stream) and one of a few conversations."""
    n = draw(st.integers(1, 40))
    parent = [draw(st.integers(-1, i - 1)) for i in range(n)]
    leaves = draw(st.lists(st.integers(-1, n - 1), max_size=n))
    conversation = [draw(st.integers(0, 3)) for _ in leaves]
    return np.array(parent, np.int64), np.array(leaves, np.int64), np.array(conversation, np.int64)


def walked(parent: np.ndarray, leaf: np.ndarray, conversation: np.ndarray) -> dict[int, int]:
    """The rule, session by session: a node's hits are shown in the latest session through it of
    the oldest conversation through it."""

    def path(node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = int(parent[node])
        return out

    first: dict[int, int] = {}
    for session in reversed(range(len(leaf))):  # newest first: the oldest writes last
        for node in path(int(leaf[session])):
            first[node] = int(conversation[session])
    out: dict[int, int] = {}
    for session in range(len(leaf)):  # oldest first: the latest writes last
        for node in path(int(leaf[session])):
            if first[node] == conversation[session]:
                out[node] = session
    return out


@given(tries())
def test_each_node_s_owner_is_the_latest_session_of_the_oldest_conversation_through_it(trie_and_sessions):
    nodes, sessions = trie.owners(*trie_and_sessions)
    assert dict(zip(nodes.tolist(), sessions.tolist(), strict=True)) == walked(*trie_and_sessions)
