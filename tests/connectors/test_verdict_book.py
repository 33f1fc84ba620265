"""The verdict book every acknowledging backend shares (shm, TE / NIXL, the Store): one report
per publication, only from its taker, replaced publications silent, overdue takes expired,
the table bounded. The backends' own tests run it over their transports."""

from __future__ import annotations

import time

import pytest

from omnikv.connectors import verdict_book
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import DeliveryReport, Verdict
from omnikv.connectors.verdict_book import VERDICT_COUNTERS, VerdictBook


def _book(ack_timeout_s: float = 60.0) -> tuple[VerdictBook, list[DeliveryReport], Counters]:
    counters = Counters(VERDICT_COUNTERS)
    book = VerdictBook(ack_timeout_s, counters)
    reports: list[DeliveryReport] = []
    book.set_listener(reports.append)
    return book, reports, counters


def test_a_verdict_counts_once_and_only_from_the_taker() -> None:
    book, reports, counters = _book()
    book.published("k@0_1", "k")
    assert not book.settle("k@0_1", "a", Verdict.REFUSED, "not taken yet")
    book.taken("k@0_1", "a")
    book.taken("k@0_1", "b")  # a taken publication keeps its taker
    assert not book.settle("k@0_1", "b", Verdict.REFUSED, "not the taker")
    assert book.settle("k@0_1", "a", Verdict.REFUSED, "no")
    assert not book.settle("k@0_1", "a", Verdict.DELIVERED, None)
    assert reports == [DeliveryReport("k", Verdict.REFUSED, "no")]
    snap = counters.snapshot()
    assert (snap["acks_refused"], snap["acks_ignored"], len(book)) == (1, 3, 0)


def test_a_returned_take_frees_the_publication_for_another_taker() -> None:
    book, reports, _ = _book()
    book.published("k@0_1", "k")
    book.taken("k@0_1", ("link", 1))
    assert book.awaiting() == 1 and book.next_due() < float("inf")
    book.returned("k@0_1", ("link", 2))  # not that offer: nothing changes
    assert book.awaiting() == 1
    book.returned("k@0_1", ("link", 1))
    assert book.awaiting() == 0
    book.taken("k@0_1", ("other", 3))
    assert book.settle("k@0_1", ("other", 3), Verdict.DELIVERED, None)
    assert reports == [DeliveryReport("k", Verdict.DELIVERED, None)]


def test_label_events_expire_or_forget_the_labels_publication() -> None:
    book, reports, counters = _book()
    book.published("a@0_1", "a")
    book.published("b@0_1", "b")
    book.expired_label("a", "TTL")
    book.forget_label("b")
    assert reports == [DeliveryReport("a", Verdict.EXPIRED, "TTL")] and len(book) == 0
    assert counters.snapshot()["acks_expired"] == 1


def test_a_gone_taker_and_an_overdue_take_end_expired() -> None:
    book, reports, counters = _book(ack_timeout_s=0.2)
    for key, taker in (("a@0_1", ("L1", 1)), ("b@0_1", ("L2", 1)), ("c@0_1", ("L1", 2))):
        book.published(key, key[0])
        book.taken(key, taker)
    assert book.expire_taken_by(lambda t: isinstance(t, tuple) and t[0] == "L1", "gone") == 2
    assert book.sweep() == []  # not due yet
    assert book.sweep(time.monotonic() + 0.3) == ["b@0_1"]
    assert sorted(r.key for r in reports) == ["a", "b", "c"]
    assert counters.snapshot()["acks_expired"] == 3 and book.next_due() == float("inf")


def test_the_store_resolves_a_publication_without_a_taker_and_clear_forgets_all() -> None:
    book, reports, _ = _book()
    old = book.published("k@0_1", "k")
    new = book.published("k@0_1", "k")
    assert not book.resolve("k@0_1", Verdict.DELIVERED, None, pub=old)  # replaced
    assert book.publications() == [("k@0_1", new, False)]
    assert book.resolve("k@0_1", Verdict.DELIVERED, None, pub=new)
    book.published("x@0_1", "x")
    assert book.clear() == ["x@0_1"] and len(book) == 0
    assert reports == [DeliveryReport("k", Verdict.DELIVERED, None)]


def test_the_table_is_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdict_book, "MAX_WATCHED", 3)
    book, _, _ = _book()
    for i in range(5):
        book.published(f"k{i}", f"k{i}")
    assert [k for k, _, _ in book.publications()] == ["k2", "k3", "k4"]
