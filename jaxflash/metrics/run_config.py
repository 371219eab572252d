"""``<workdir>/run_config.json``: the experiment as a launch ran it, and its stop set.

Written once the learner took the workdir (a refused launch leaves the file of the
run as it was); a resumed launch that changes a setting keeps the previous file as
``run_config.<n>.json`` and names every changed field. Host-side, no jax.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def write_run_config(workdir: str, exp: Any, tokenizer: Any, prompt_lengths: Any) -> str:
    """Writes ``<workdir>/run_config.json`` (making ``workdir``): the experiment as run and
    the stop set.

    The experiment after everything derived at start (the task's reward, the prompt
    limits measured from the data), the prompt lengths measured, and the
    tokenizer's stop set: every id that ends a response, its token and the
    sources that named it (eos, generation_config.json, GGUF eot, the template).
    Rewritten at every start, so it describes the latest launch; when a resumed
    launch changes a setting other than ``total_steps``, the previous file is kept as
    ``run_config.<n>.json`` and a warning names every changed field.

    Returns:
      The file's path.
    """
    os.makedirs(workdir, exist_ok=True)  # only once the config is known to run
    stops = tokenizer.stop_set
    info = {
        "experiment": dataclasses.asdict(exp),
        "prompt_lengths": dataclasses.asdict(prompt_lengths),
        "stop_set": {
            "ids": sorted(stops.ids),
            "tokens": {str(i): tokenizer.id_to_token(i) for i in sorted(stops.ids)},
            "sources": {str(i): list(stops.sources[i]) for i in sorted(stops.ids)},
            "describe": stops.describe(tokenizer.id_to_token),
        },
    }
    path = os.path.join(workdir, "run_config.json")
    info = json.loads(json.dumps(info, default=str))  # as it reads back
    changed = _changed_settings(path, info["experiment"])
    if changed:
        n = 1
        while os.path.exists(os.path.join(workdir, f"run_config.{n}.json")):
            n += 1
        os.replace(path, os.path.join(workdir, f"run_config.{n}.json"))
        log.warning(
            "this launch changes settings of the run in %s: %s (the previous settings are "
            "kept in run_config.%d.json)", workdir, "; ".join(changed), n
        )  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return path


def _changed_settings(path: str, new: dict[str, Any]) -> list[str]:
    """ "field: old -> new" for each setting that differs from ``path``'s (total_steps,
    the documented way to train further, excepted); [] when there is no earlier file."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)["experiment"]
    except (OSError, ValueError, KeyError):
        return []

    def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for k, v in tree.items():
                out.update(leaves(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: tree}

    a, b = leaves(old), leaves(new)
    keys = sorted((set(a) | set(b)) - {"total_steps", "learner.total_steps"})
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
