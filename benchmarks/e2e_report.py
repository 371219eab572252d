"""The table of ``benchmarks/e2e_vs_tunix.py``: rates, step sections, curves, ratios.

Merge runs of several ``--out`` files (one seed each) and print them:

    python benchmarks/e2e_report.py seed0.json seed1.json

Pure Python over the workers' JSON results (no jax), so it is testable on fakes.
"""

from __future__ import annotations

import math
import statistics


def steady_steps(per_step: list[dict], eval_every: int) -> list[dict]:
    """Steps counted in the rates: not step 1 (compile) and not a step whose interval
    holds an evaluation (jaxflash evaluates after step k inside step k+1's interval,
    so step k+1 with k a multiple of ``eval_every`` is left out, for every system)."""
    return [
        s for s in per_step
        if s["step"] >= 2 and (s["step"] - 1) % eval_every and s.get("wall_s") is not None
    ]  # fmt: skip


def run_rates(run: dict, eval_every: int) -> dict:
    """Trained samples per wall / CPU second, tokens and mean sections over the steady steps."""
    steps = steady_steps(run["per_step"], eval_every)
    if not steps:
        return {}
    samples = sum(s["samples"] for s in steps)
    wall = sum(s["wall_s"] for s in steps)
    cpu = sum(s["cpu_s"] for s in steps)
    sections: dict[str, float] = {}
    for s in steps:
        for k, v in s["sections"].items():
            sections[k] = sections.get(k, 0.0) + v / len(steps)
    return {
        "steps": [s["step"] for s in steps],
        "samples_per_s": samples / wall,
        "samples_per_cpu_s": samples / cpu,
        "cpu_per_wall": cpu / wall,
        "step_s": wall / len(steps),
        "tokens_per_sample": sum(s["tokens"] for s in steps) / max(samples, 1),
        "sections": sections,
        "first_step_s": next((s["wall_s"] for s in run["per_step"] if s["step"] == 1), None),
    }


def repeated_prefixes(prefixes: list[list[list[int]]]) -> dict:
    """How often a row's response opening repeats in the next training step.

    Args:
      prefixes: per training step, every row's first response tokens (tunix worker's
        ``row_prefixes``: rows in batch order, B x G).

    Returns:
      {"same_row": fraction of (step, row) pairs whose opening equals the same row's in
       the previous step, "other_rows": the same fraction over pairs of different rows
       of consecutive steps (the chance level of equal openings), "pairs": number of
       same-row pairs}. A sampler that draws every step with the same key stream (tunix
       keys a token by decode position only) shows same_row above other_rows.
    """
    same = other = n_same = n_other = 0
    for a, b in zip(prefixes, prefixes[1:], strict=False):
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                if i == j:
                    same, n_same = same + (x == y), n_same + 1
                else:
                    other, n_other = other + (x == y), n_other + 1
    return {"same_row": same / max(n_same, 1), "other_rows": other / max(n_other, 1),
            "pairs": n_same}  # fmt: skip


def _mean_spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.mean(xs))} ({', '.join(fmt.format(x) for x in xs)})"


def print_report(runs: dict[str, list[dict]], work: dict, *, skip_every: int) -> dict:
    """Print the tables; returns {system: {rates per seed, curve points}, ratios}."""
    out: dict = {"systems": {}, "ratios": {}}
    print(
        f"\nGRPO job: B = {work['prompts_per_step']} prompts x G = {work['group_size']} samples,"
        f" {work['steps']} steps, max_new_tokens {work['max_new_tokens']}, lr {work['lr']},"
        f" eval every {work['eval_every']} steps (mean@{work['eval_samples']}, "
        f"{work['eval_prompts']} held-out prompts). Rates over steady steps (not step 1, "
        "not steps holding an evaluation); mean over seeds (per seed in brackets)."
    )
    print(
        "| system | trained samples/s | samples/CPU-s | CPU-s per wall-s | s/step | step 1 s "
        "(compile) | tokens/sample | load (1 min) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for system, rs in runs.items():
        rates = [run_rates(r, skip_every) for r in rs]
        out["systems"][system] = {"rates": rates, "curves": [r["curve"] for r in rs]}
        loads = ", ".join(f"{r['load'][0]:.1f}" for r in rs)
        cells = [
            _mean_spread([x.get(k) for x in rates if x], fmt)
            for k, fmt in (
                ("samples_per_s", "{:.3f}"), ("samples_per_cpu_s", "{:.3f}"),
                ("cpu_per_wall", "{:.2f}"), ("step_s", "{:.1f}"), ("first_step_s", "{:.0f}"),
                ("tokens_per_sample", "{:.1f}"),
            )
        ]  # fmt: skip
        print(f"| {system} | {' | '.join(cells)} | {loads} |")
    print("\nTime per steady step by each system's own timers (s, mean over seeds):")
    for system, info in out["systems"].items():
        keys = sorted({k for x in info["rates"] if x for k in x["sections"]})
        cells = [
            f"{k} {statistics.mean(x['sections'].get(k, 0.0) for x in info['rates'] if x):.2f}"
            for k in keys
        ]
        print(f"  {system}: " + ", ".join(cells))
    base = out["systems"].get("tunix")
    for system, info in out["systems"].items():
        if system == "tunix" or not base:
            continue
        for key in ("samples_per_s", "samples_per_cpu_s"):
            pairs = [
                (o[key], t[key])
                for o, t in zip(info["rates"], base["rates"], strict=False)
                if o and t
            ]
            ratio = [o / t for o, t in pairs]
            out["ratios"][f"{system}/tunix {key}"] = ratio
            print(f"ratio {system}/tunix {key} per seed: {_mean_spread(ratio, '{:.2f}')}")
    print("\nHeld-out accuracy (mean@n, T = 1) at equal trained samples, per seed:")
    print("| system | " + " | ".join(f"seed {r['seed']}" for r in next(iter(runs.values()))) + " |")
    for system, rs in runs.items():
        cells = []
        for r in rs:
            cells.append(
                "; ".join(f"{p['trained']}: {p['accuracy']:.3f}" for p in r["curve"]) or "n/a"
            )
        print(f"| {system} | " + " | ".join(cells) + " |")
    for system, rs in runs.items():
        deltas = [r["curve"][-1]["accuracy"] - r["curve"][0]["accuracy"]
                  for r in rs if len(r["curve"]) >= 2]  # fmt: skip
        out["systems"][system]["gain"] = deltas
        if deltas:
            print(f"  {system}: accuracy gain first -> last eval per seed: "
                  f"{_mean_spread(deltas, '{:+.3f}')}")  # fmt: skip
    for system, rs in runs.items():
        same = [r.get("same_prompts") for r in rs if "same_prompts" in r]
        if same:
            print(f"  {system} trained the driver's prompt rows: {same}")
    for system, rs in runs.items():
        stats = [repeated_prefixes(r["row_prefixes"]) for r in rs if r.get("row_prefixes")]
        if stats:
            cells = [f"{x['same_row']:.2f} (other rows {x['other_rows']:.2f}, {x['pairs']} pairs)"
                     for x in stats]  # fmt: skip
            print(f"  {system}: a row's first 8 response tokens equal to the same row's in "
                  f"the previous step, per seed: {cells}")  # fmt: skip
    for system, rs in runs.items():
        masked = [r["untrained_stop_tokens"] for r in rs if r.get("untrained_stop_tokens")]
        if masked:
            cells = [f"{m['stop_masked']} of {m['rows']}" for m in masked]
            print(f"  {system}: responses whose stop token got no loss, per seed: {cells}")
    return out


def merge(results: list[dict]) -> tuple[dict[str, list[dict]], dict]:
    """The runs of several ``e2e_vs_tunix.py --out`` files (e.g. one seed each) as one
    result: runs per system in file order; the workloads must match but for the seed.

    Raises:
      ValueError: workloads that differ (names the first differing key).
    """
    work = results[0]["work"]
    runs: dict[str, list[dict]] = {}
    for r in results:
        diff = sorted(k for k in set(work) | set(r["work"]) if work.get(k) != r["work"].get(k))
        if diff:
            raise ValueError(f"e2e_report.merge: the files' workloads differ in {diff}")
        for system, rs in r["runs"].items():
            runs.setdefault(system, []).extend(rs)
    return runs, work


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/e2e_report.py RESULT.json [RESULT.json ...]")
    loaded = []
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            loaded.append(json.load(f))
    merged_runs, merged_work = merge(loaded)
    print_report(merged_runs, merged_work, skip_every=merged_work["eval_every"])
