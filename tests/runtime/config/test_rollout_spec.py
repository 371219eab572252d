"""The ``rollout`` section on its own: field checks, refused ignored settings, the filter knobs."""

import pytest

from jaxflash.runtime.config.rollout_spec import RolloutSpec
from jaxflash.runtime.config.specs import ConfigError


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompts_per_step": 0}, "rollout.prompts_per_step"),
        ({"group_size": 0}, "rollout.group_size"),
        ({"truncation": "cut"}, "rollout.truncation"),
        ({"async_ratio": 1, "partial_rollout": "pause"}, "rollout.partial_rollout"),
        ({"stale_policy": "regenerate"}, "rollout.stale_policy"),  # needs async_ratio > 0
        ({"truncation": "mask", "truncation_penalty": -1.0}, "rollout.truncation_penalty"),
        ({"filter_min_std": 0.0}, "rollout.filter_min_std"),
        ({"filter_min_mean": 0.6, "filter_max_mean": 0.4}, "rollout.filter_min_mean"),
        ({"group_redundancy": -1}, "rollout.group_redundancy"),
    ],
)
def test_refuses_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        RolloutSpec(**kwargs)


def test_async_settings_accepted_with_async_ratio():
    spec = RolloutSpec(async_ratio=2, partial_rollout="recompute", stale_policy="regenerate")
    assert (spec.partial_rollout, spec.stale_policy) == ("recompute", "regenerate")


def test_group_filter_kwargs():
    assert RolloutSpec().group_filter_kwargs() is None
    assert RolloutSpec(filter_max_mean=0.9).group_filter_kwargs() == {
        "zero_variance": False,
        "min_mean": None,
        "max_mean": 0.9,
        "min_std": None,
    }
