"""``replay.buffer_books``: the group buffer's counters, their identity and checkpoint."""

import pytest

from jaxflash.replay.buffer_books import BufferBooks
from jaxflash.replay.staleness import Verdict


def test_books_round_trip_a_checkpoint_without_the_pending_groups():
    books = BufferBooks()
    books.produced = 5  # 3 left (1 returned, 2 dropped), 2 pending
    books.returned = 1
    books.drop("stale")
    books.drop("failed")
    books.judge(Verdict.FRESH)
    books.judge(Verdict.STALE)
    books.overshoot, books.late_discarded = 1, 4
    counts = books.counts(pending=2)
    assert counts["produced"] == counts["returned"] + counts["dropped"] + counts["pending"]
    assert (counts["dropped_stale"], counts["staleness_fresh"], counts["staleness_stale"]) == (
        1,
        1,
        1,
    )
    state = books.state_dict(pending=2)
    assert state["produced"] == 3  # the pending groups are produced again on resume
    resumed = BufferBooks.from_state(state)
    assert resumed.counts(pending=0) == {**counts, "produced": 3, "pending": 0}


@pytest.mark.parametrize(
    "change",
    [
        {"produced": 9},  # does not add up
        {"unknown": 1},  # not a state_dict key
        {"returned": None},  # a key missing (removed below)
    ],
)
def test_books_refuse_a_state_that_is_not_theirs(change):
    books = BufferBooks(produced=2, returned=1)
    books.drop("stale")
    state = {**books.state_dict(pending=0), **change}
    state = {k: v for k, v in state.items() if v is not None}
    with pytest.raises(ValueError, match="not a state_dict"):
        BufferBooks.from_state(state)
