"""Parameters written into the SQL text must mean what they meant as parameters."""

import datetime as dt

import duckdb
import pytest

from kvdb.storage.literals import ANY, LIST_LITERAL, bound, literal_connection


@pytest.fixture
def conn():
    raw = duckdb.connect(":memory:")
    raw.execute("create table t (k varchar, n bigint, b blob, f double, ts timestamp)")
    yield literal_connection(raw)
    raw.close()


AWKWARD = ["it's", "?", "'; drop table t; --", "a\nb", "\\", '"quoted"', "", "naïve 東京", "nul\x00inside", "'?'"]


@pytest.mark.parametrize("text", AWKWARD)
def test_text_reads_back_exactly_written_in_or_bound(conn, text):
    conn.execute("insert into t (k, n) values (?, ?)", [text, 1])
    assert conn.execute("select k from t where k = ? and n = ?", [text, 1]).fetchall() == [(text,)]
    assert conn.execute("select count(*) from t").fetchone()[0] == 1


def test_values_without_an_exact_literal_stay_parameters(conn):
    query, left = bound(
        "insert into t values (?, ?, ?, ?, ?)", ["k", 2**40, b"\x00\x01", 0.1, dt.datetime(2026, 12, 5, 15, 30, 1, 250)]
    )
    assert left == [b"\x00\x01", 0.1]
    assert "'k'" in query and str(2**40) in query and "TIMESTAMP '2026-12-05 15:30:01.000250'" in query
    conn.execute(
        "insert into t values (?, ?, ?, ?, ?)", ["k", 2**40, b"\x00\x01", 0.1, dt.datetime(2026, 12, 5, 15, 30, 1, 250)]
    )
    assert conn.execute("select * from t").fetchall() == [
        ("k", 2**40, b"\x00\x01", 0.1, dt.datetime(2026, 12, 5, 15, 30, 1, 250))
    ]


def test_a_list_among_values_becomes_an_in_list_and_a_long_one_stays_bound(conn):
    conn.execute("insert into t (k, n) select 'k' || i, i from range(200) r(i)")
    short = [f"k{i}" for i in range(5)] + ["it's"]
    query, left = bound(f"select n from t where k {ANY} order by n", [short])
    assert left == [] and "unnest" not in query
    assert conn.execute(f"select n from t where k {ANY} order by n", [short]).fetchall() == [(i,) for i in range(5)]
    long = [f"k{i}" for i in range(LIST_LITERAL + 1)]
    assert bound(f"select n from t where k {ANY}", [long])[1] == [long]
    assert len(conn.execute(f"select n from t where k {ANY}", [long]).fetchall()) == LIST_LITERAL + 1
    assert conn.execute(f"select n from t where k {ANY}", [[]]).fetchall() == []


def test_a_question_mark_inside_quotes_is_no_placeholder(conn):
    conn.execute("insert into t (k, n) values ('?', ?)", [7])
    assert conn.execute("select n from t where k = '?' and n = ?", [7]).fetchall() == [(7,)]


def test_a_wrong_count_of_parameters_is_duckdbs_error(conn):
    with pytest.raises(duckdb.Error):
        conn.execute("select ? + ?", [1])
