"""benchmarks/retrieval.py's retrieval set: which functions it keeps, what it searches for, and
what it searches (the source less the docstring), on a small source written here."""

import textwrap

import retrieval as R

SOURCE = textwrap.dedent(
    '''\
    import os

    @decorator
    def scale(values,
              factor=2):
        """Multiply every value by the given factor.

        More text that is not part of the query.
        """
        # a comment stays
        out = []
        for v in values:
            out.append(v * factor)
        return out

    def short_doc(x):
        """Too few words here."""
        a = x
        b = a
        return b

    def inline(x): "Docstring on the def line itself, five words or more."; return x

    def only_doc():
        """A function with nothing but its docstring here."""

    class Box:
        def fill(self, n):
            """Fill the box with n copies of its item."""
            self.items = [self.item] * n
            self.count = n
            return self

            def nested():
                """Nested functions are never taken as targets at all."""
                return 1
    '''
)


def test_functions_keep_the_def_line_and_body_and_drop_the_docstring():
    found = {item.name: (item, body) for item, body in R.functions(SOURCE, "mod")}
    # no docstring on its own lines, none after it, nested
    assert set(found) == {"mod.scale", "mod.short_doc", "mod.Box.fill"}
    item, body = found["mod.scale"]
    assert item.query == "Multiply every value by the given factor."
    assert item.document == (
        "def scale(values,\n          factor=2):\n    # a comment stays\n    out = []\n"
        "    for v in values:\n        out.append(v * factor)\n    return out\n"
    )
    assert body == 5 and "@decorator" not in item.document and '"""' not in item.document
    fill, _ = found["mod.Box.fill"]
    assert fill.document.startswith("def fill(self, n):\n    self.items")  # dedented out of the class
    assert "def nested" in fill.document  # part of fill's body, not a target of its own


def test_eligible_applies_the_word_and_line_limits_and_drops_shared_queries():
    item = lambda name, query, doc="def f():\n    pass\n": R.Item(name, query, doc)  # noqa: E731
    found = [
        (item("m.ok", "Return the sum of two numbers.", "def ok(): ..."), 3),
        (item("m.few", "Return the sum.", "def few(): ..."), 3),
        (item("m.short", "Return the sum of two numbers quickly.", "def short(): ..."), R.MIN_LINES - 1),
        (item("m.long", "Return the sum of two numbers slowly.", "def long(): ..."), R.MAX_LINES + 1),
        (item("m.a", "Return the path of the named file.", "def a(): ..."), 4),
        (item("m.b", "Return the path of the named file.", "def b(): ..."), 4),
        (item("m.c", "Return the name of the named file.", "def same(): ..."), 4),
        (item("n.c", "Return the size of the named file.", "def same(): ..."), 4),
    ]
    assert [i.name for i in R.eligible(found)] == ["m.ok"]


def test_choose_is_deterministic_and_keeps_targets_apart_from_the_rest():
    items = [R.Item(f"m.f{i:02d}", f"query number {i} has five words", f"def f{i}(): ...") for i in range(30)]
    chosen, rest = R.choose(items, 10, seed=0)
    assert chosen == R.choose(items, 10, seed=0)[0] != R.choose(items, 10, seed=1)[0]
    assert [i.name for i in chosen] == sorted(i.name for i in chosen) and len(rest) == 20
    assert {i.name for i in chosen} | {i.name for i in rest} == {i.name for i in items}
    assert not {i.name for i in chosen} & {i.name for i in rest}


def test_scoring_counts_distinct_sessions():
    assert R.distinct(["a", "a", "b", "a", "c"]) == ["a", "b", "c"]
    rankings = [("t", ["t", "x"]), ("t", ["x"] * 30 + ["t"]), ("t", [f"s{i}" for i in range(10)] + ["t"]), ("t", [])]
    assert R.score(rankings) == (0.25, 0.5)  # the second: t is the 2nd distinct session; the third: the 11th
