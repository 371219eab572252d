"""Host-side padding of the engine's program inputs (engine.host_arrays), by hand."""

import numpy as np
import pytest

from jaxflash.generation.engine.host_arrays import (
    block_result,
    identity_rows,
    pow2,
    prefill_groups,
    start_groups,
    stop_array,
)
from jaxflash.generation.engine.state import PromptPrefill, SampleStart


def test_prefill_groups_pad_each_bucket_to_fixed_rows():
    seqs = [np.arange(1, n + 1, dtype=np.int32) for n in (3, 20, 5, 4)]
    groups = list(prefill_groups(seqs, lambda n: 16 if n <= 16 else 32, rows=2))
    assert [g for g, _, _ in groups] == [[0, 2], [3], [1]]
    _, ids, lengths = groups[1]  # one sequence, padded with a copy of it
    np.testing.assert_array_equal(lengths, [4, 4])
    np.testing.assert_array_equal(ids[0], [1, 2, 3, 4] + [0] * 12)
    np.testing.assert_array_equal(ids[1], ids[0])
    assert groups[2][1].shape == (2, 32)


def test_identity_and_stop_padding():
    assert [pow2(n) for n in (0, 1, 2, 3, 5, 8)] == [1, 1, 2, 4, 8, 8]
    rows = identity_rows([(7, 1, 0), (7, 1, 1), (7, 2, 0)], token_index=3)
    np.testing.assert_array_equal(rows, [[7, 1, 0, 3], [7, 1, 1, 3], [7, 2, 0, 3], [7, 1, 0, 3]])
    np.testing.assert_array_equal(stop_array([2, 5]), [2, 5, -1, -1, -1, -1, -1, -1])
    assert stop_array(list(range(9))).shape == (16,)


def test_start_groups_per_batch_and_errors():
    a, b = object(), object()  # stand-ins for two PrefillBatch objects

    def start(batch, row, slot, budget=3):
        prefill = PromptPrefill(batch=batch, row=row, true_length=5)
        return SampleStart(
            prefill=prefill,
            slot=slot,
            seed=1,
            prompt_id=row,
            sample_index=0,
            token_index=0,
            budget=budget,
        )

    groups = start_groups([start(a, 0, 2), start(b, 0, 0), start(a, 1, 1)], num_slots=4)
    assert [m for m, _ in groups] == [[0, 2], [1]]
    row_g, slot_g, ident_g4, budget_g = groups[0][1]
    np.testing.assert_array_equal(row_g, [0, 1])
    np.testing.assert_array_equal(slot_g, [2, 1])
    row_g, slot_g, ident_g4, budget_g = groups[1][1]
    np.testing.assert_array_equal(slot_g, [0])
    groups = start_groups([start(a, 0, 0), start(a, 1, 1), start(a, 2, 2)], num_slots=4)
    np.testing.assert_array_equal(groups[0][1][1], [0, 1, 2, 4])  # padding -> slot B, dropped
    with pytest.raises(ValueError, match="distinct"):
        start_groups([start(a, 0, 1), start(a, 1, 1)], num_slots=4)
    with pytest.raises(ValueError, match="budget"):
        start_groups([start(a, 0, 1, budget=-1)], num_slots=4)


def test_block_result_unpacks_tokens_logprobs_and_flags():
    logp = np.array([[-0.5, -1.25], [-2.0, 0.0], [9.0, 9.0]], np.float32)
    out = np.zeros((3, 2, 3), np.int32)
    out[:, :, 0] = [[5, 6], [7, 0], [1, 1]]
    out[:, :, 1] = logp.view(np.int32)
    out[:, :, 2] = [[1, 1], [1, 0], [1, 1]]
    r = block_result(out, np.array([2, 1, 9]), steps_run=2)
    assert r.steps == 2
    np.testing.assert_array_equal(r.tokens_nb, [[5, 6], [7, 0]])
    np.testing.assert_array_equal(r.logps_nb, logp[:2])
    np.testing.assert_array_equal(r.emitted_nb, [[True, True], [True, False]])
    np.testing.assert_array_equal(r.live_n, [2, 1])
