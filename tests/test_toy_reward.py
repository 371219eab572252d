from jaxflash.rewards import get_reward_fn


def test_digit_fraction_counts_response_digits_only():
    fn = get_reward_fn("digit_fraction")
    assert fn("ab 12", "ignored").score == 0.5
    assert fn("", "7").score == 0.0
    assert fn("   ", "7").score == 0.0
    assert fn("2024", "x").score == 1.0
