"""Checks of a written run report: every PNG opens, is the size its sidecar says, is
not blank, and has the panels expected (titles recorded in report.json)."""

import json
import os

import numpy as np
from matplotlib import image

from jaxflash.report.__main__ import main

CURVE_PANELS = {
    f"{prefix}{label} vs {x}"
    for prefix, label in (("", "reward"), ("held-out ", "accuracy"))
    for x in ("learner step", "trained samples", "wall time (s)")
}


def check_report_pngs(sources, figures, *, out=None, timeline_step=None):
    """Write the report of ``sources`` (a workdir or a list) through the CLI, check it.

    Returns:
      The sidecar (report.json).
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    out = out or os.path.join(sources[0], "report")
    argv = [*sources, "--out", out]
    assert main(argv) == 0
    with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
        sidecar = json.load(f)
    assert set(sidecar["figures"]) == set(figures)
    for name, fig in sidecar["figures"].items():
        pixels = image.imread(fig["path"])
        assert pixels.shape[:2] == (fig["height"], fig["width"]), name
        ink = np.mean(np.any(pixels[..., :3] < 0.9, axis=-1))  # share of non-white pixels
        assert ink > 0.01, f"{name} is blank ({ink:.3%} ink)"
        assert fig["panels"] and all(fig["panels"]), name
    if "curves" in figures:
        assert set(sidecar["figures"]["curves"]["panels"]) == CURVE_PANELS
    if timeline_step is not None:
        panels = sidecar["figures"]["timeline"]["panels"]
        assert all(p.startswith(f"timeline of step {timeline_step}: ") for p in panels), panels
    return sidecar
