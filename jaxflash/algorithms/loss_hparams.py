"""Config-time checks of a policy loss's keyword hyper-parameters: names, types, ranges.

The losses of ``policy_loss`` check their Python-number hyper-parameters when they
are traced, i.e. at the first train step, after the model is loaded; a config
reader calls ``check_loss_hparams`` instead, before anything is built. A name's
type is its annotation in the loss's signature (``float``, ``float | None``,
``bool``; bool is not a number, an int is a float, numbers must be finite); its
range is ``HPARAM_RANGES[name]``, one rule per name shared by every loss that takes
it (the same bounds the losses' own checks apply; a test holds every loss's every
hyper-parameter to having one).
"""

from __future__ import annotations

import inspect
import math
import numbers
import typing
from collections.abc import Callable, Mapping
from typing import Any

from jaxflash.algorithms.policy_loss import POLICY_LOSSES

HPARAM_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "clip_eps_low": (lambda v: 0.0 <= v <= 1.0, "in [0, 1] (ratios are positive)"),
    "clip_eps_high": (lambda v: v >= 0.0, ">= 0"),
    "dual_clip_c": (lambda v: v > 1.0, "> 1"),
    "behaviour_cap": (lambda v: v > 0.0, "> 0"),
    "tis_cap": (lambda v: v > 0.0, "> 0"),
    "mask_eps_low": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "mask_eps_high": (lambda v: v >= 0.0, ">= 0"),
    "tau": (lambda v: v > 0.0, "> 0"),
    "m2_threshold": (lambda v: v >= 0.0, ">= 0"),
    "mis_upper": (lambda v: v >= 1.0, ">= 1 (rho = 1 is always kept)"),
    "mis_lower": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "icepop_high": (lambda v: v >= 1.0, ">= 1 (rho = 1 is always kept)"),
    "icepop_low": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
}
"""Range of each numeric hyper-parameter name (bool ones have none)."""


def loss_hparam_types(loss: str) -> dict[str, Any]:
    """The keyword hyper-parameters of ``POLICY_LOSSES[loss]`` and their annotated types."""
    fn = POLICY_LOSSES[loss]
    hints = typing.get_type_hints(fn)
    return {
        name: hints[name]
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind == p.KEYWORD_ONLY and name != "behaviour_logp_bt"
    }


def _expected(hint: Any, value: Any) -> str | None:
    """What ``value`` should be for ``hint`` (None when its type fits)."""
    optional = type(None) in typing.get_args(hint)
    if optional and value is None:
        return None
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if base is bool:
        return None if isinstance(value, bool) else "a bool"
    if base is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and math.isfinite(value):
            return None
        return "a finite number" + (" or None" if optional else "")
    raise TypeError(f"loss_hparams: no check for a hyper-parameter annotated {hint!r}")


def check_loss_hparams(loss: str, kwargs: Mapping[str, Any], *, where: str) -> None:
    """Refuse hyper-parameters ``loss`` does not take, of the wrong type or out of range.

    Args:
      loss: a ``POLICY_LOSSES`` name (checked by the caller).
      kwargs: the keyword hyper-parameters as configured (e.g. {"tis_cap": 2.0}).
      where: the config field holding ``kwargs``, named in every message
        (``replay.correction_kwargs`` -> ``replay.correction_kwargs.tis_cap ...``).

    Raises:
      ValueError: naming ``<where>.<name>``, the value and what is expected.
    """
    types = loss_hparam_types(loss)
    unknown = sorted(set(kwargs) - set(types))
    if unknown:
        raise ValueError(
            f"{where} has keys {unknown} that loss {loss!r} does not take; it takes {sorted(types)}"
        )
    for name, value in kwargs.items():
        expected = _expected(types[name], value)
        if expected is None and value is not None and name in HPARAM_RANGES:
            in_range, words = HPARAM_RANGES[name]
            expected = None if in_range(float(value)) else f"a number {words}"
        if expected is not None:
            raise ValueError(f"{where}.{name} must be {expected}, got {value!r}")
