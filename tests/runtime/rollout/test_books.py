"""rollout.books.Books: the run's counters add up across a restart (the checkpoint's plus
the books' own plus each part's), and the step's snapshot is what a checkpoint of that
step saves."""

import threading
import types

from jaxflash.runtime.rollout.books import Books, BooksSnapshot


def _books(restored, parts):
    ledger = types.SimpleNamespace(
        state_dict=lambda: {"open": [3]}, outcomes={"trained": {}}, open_ids=[3],
        metrics=lambda: {"prompts_open": 1},
    )  # fmt: skip
    buffer = types.SimpleNamespace(state_dict=lambda: {"complete": 2})
    source = types.SimpleNamespace(cursor=7)
    return Books(
        ledger=ledger, buffer=buffer, source=source, restored=restored, parts=parts,
        lock=threading.RLock(),
    )  # fmt: skip


def test_counters_are_the_checkpoints_plus_own_plus_each_parts():
    part = {"samples_generated": 4}
    books = _books({"samples_generated": 10, "steps_skipped": 1}, [lambda: part])
    books.count("steps_skipped", "steps_skipped_all_failed")
    books.count("prompts_regenerated_on_resume", n=0)  # listed, as 0 (metrics.jsonl keeps it)
    part["samples_generated"] = 6  # parts are read when asked, not when built
    counters = books.counters()
    assert dict(counters) == {
        "samples_generated": 16,
        "steps_skipped": 2,
        "steps_skipped_all_failed": 1,
        "prompts_regenerated_on_resume": 0,
    }


def test_close_step_keeps_the_snapshot_a_checkpoint_saves():
    books = _books({"samples_generated": 1}, [])
    assert books.step_books is None
    books.close_step()
    books.count("samples_generated")  # after the step: not in its snapshot
    assert books.step_books == BooksSnapshot(
        {"open": [3]}, {"samples_generated": 1}, 7, {"complete": 2}
    )
    assert books.snapshot().counters == {"samples_generated": 2}
    assert books.open_ids == [3] and books.ledger_metrics() == {"prompts_open": 1}
