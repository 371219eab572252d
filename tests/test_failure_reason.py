import pytest

from jaxflash.runtime.ledger import failure_reason


@pytest.mark.parametrize(
    ("detail", "reason"),
    [
        ("prompt 1: malformed row: data.jsonl:2: bad JSON", "malformed_row"),
        ("prompt 3 is 231 tokens, longer than max_prompt_tokens=48", "prompt_too_long"),
        ("prompt 4: prompt of 90 tokens exceeds max_prefill_length=64 tokens", "prompt_too_long"),
        ("prompt 5: reward error: RuntimeError('boom') scoring prompt 5", "reward_error"),
        ("prompt 6: reward error: timeout after 2.0s scoring prompt 6 sample 0", "reward_timeout"),
        ("prompt 7: sample 1 not back within 0.5s after 2 tries", "generation_timeout"),
        ("prompt 8: something new", "other"),
    ],
)
def test_failure_reason(detail, reason):
    assert failure_reason(detail) == reason
