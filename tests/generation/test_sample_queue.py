"""``generation.sample_queue``: a sample's tokens until it finishes, and the queue order."""

import numpy as np
import pytest

from jaxflash.generation.sample_queue import RunningSample, SampleQueue
from jaxflash.types import FinishReason, GenerationRequest, SamplingParams


def _request(prompt_id, sample_index=0, max_new=3):
    return GenerationRequest(
        prompt_id=prompt_id,
        sample_index=sample_index,
        prompt_tokens=np.arange(4, dtype=np.int32),
        sampling=SamplingParams(max_new_tokens=max_new),
    )


def test_a_sample_ends_at_a_stop_id_or_its_budget_and_keeps_each_tokens_version():
    run = RunningSample(_request(1), start_version=2)
    assert run.append(5, -0.5, 2, stop_ids={9}) is None
    assert run.append(6, -0.25, 3, stop_ids={9}) is None
    assert run.append(7, -1.0, 3, stop_ids={9}) is FinishReason.LENGTH
    sample = run.to_sample(FinishReason.LENGTH, version=4)
    assert sample.response_tokens.tolist() == [5, 6, 7]
    assert sample.token_versions.tolist() == [2, 3, 3] and sample.start_version == 2
    np.testing.assert_array_equal(sample.behaviour_logprobs, np.float32([-0.5, -0.25, -1.0]))
    eos = RunningSample(_request(2), start_version=0)
    assert eos.append(9, -0.1, 0, stop_ids={9}) is FinishReason.EOS  # the stop id is kept
    assert eos.to_sample(FinishReason.EOS, 0).response_tokens.tolist() == [9]
    # Aborted while queued: no tokens, the current version as its start.
    never = RunningSample(_request(3), start_version=None).to_sample(FinishReason.ABORTED, 7)
    assert never.start_version == 7 and never.response_tokens.size == 0


def test_the_queue_is_first_come_first_served_and_sent_back_samples_go_first():
    queue = SampleQueue()
    for i in range(3):
        queue.add(RunningSample(_request(i), None))
    back = RunningSample(_request(9), None, tokens=[1])
    queue.add_first(back)
    assert len(queue) == 4 and (9, 0) in queue and queue.head() is back
    assert [p.tolist() for p in queue.fresh_prompts()] == [[0, 1, 2, 3]] * 3  # no prefix
    assert queue.pop((1, 0)).key == (1, 0)
    assert [queue.pop_head().key for _ in range(3)] == [(9, 0), (0, 0), (2, 0)]
    with pytest.raises(KeyError):
        queue.pop((1, 0))
