from jaxflash.rewards import get_reward_fn


def test_uppercase_fraction_counts_response_letters_only():
    fn = get_reward_fn("uppercase_fraction")
    assert fn("AmazingOUTPUT", "ignored").score == 7 / 13
    assert fn("ab CD 12", "x").score == 0.5
    assert fn("", "7").score == 0.0
    assert fn("123 !?", "7").score == 0.0
