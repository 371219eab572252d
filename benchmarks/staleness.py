"""How stale can training be? Learning under staleness on a laptop CPU.

    python benchmarks/staleness.py                      # quick grid, < 30 min on 2 cores
    python benchmarks/staleness.py --grid full          # full grid (hours; see docs/STALENESS.md)
    python benchmarks/staleness.py --smoke              # 3 tiny runs: plumbing (the test)
    python benchmarks/staleness.py --losses ppo cispo --alphas 0 2 --seeds 3

Task and model (chosen to learn from scratch by RL within the step budget on 2
cores). ``data.task=digits``: reverse a string of ``--length`` (2) digits
("reverse 3 1" -> "13"), reward ``digit_match`` = the share of positions right:

* partial credit: each position learned adds 1 / length, so GRPO gets a signal
  long before a response is fully right (an exact-match reward a random model
  never earns gives it none);
* small vocabulary: a 16-word tokenizer (the digits, the op words, ``=``,
  ``<eos>``, ``<pad>``) written here as a Hugging Face directory with a
  random-init model of the real architecture (the "tiny" preset at d_model 128:
  2 Llama blocks, GQA 4/2 heads, RoPE, SwiGLU, tied embeddings; ``model.source=hf``)
  — with SmolLM2's 49152-word vocabulary a random model almost never emits a digit;
  the random policy scores ~0.05 (a digit in the right place 1 time in 16);
* short responses: exactly ``length`` sampled tokens (``max_new_tokens``; a
  truncated response keeps its reward), so a step of 32 x 8 samples is ~1 s.

Measured before the grid (sync, ppo, lr 3e-3, 2 cores at load ~10): with the
defaults the held-out reward goes 0.05 -> 0.51 / 0.63 / 0.66 at steps 20 / 30 / 40
(0.72 at 60). Three digits learned too slowly for a grid: 0.51 after 250 steps
at B = 16, d_model 64, and with lr 1e-2 it collapsed to 0.24 (entropy -> 0, so
every group's samples agree and GRPO has no signal); ``--entropy_coef`` 0.02
delays that collapse. Reversal rather than copying: each output position
attends to a different input offset; copying 3 digits learned no faster here.

Modes (each result row says which):

* ``sched`` — staleness made real by the runtime's own scheduler
  (``runtime.loop.run``, as the real runs): α = 0 is the colocated synchronous
  run; α >= 1 runs the learner on device 0 and one generation slice on device 1
  with ``rollout.async_ratio = α`` (queue scheduling, weights published while
  generation continues, groups older than α dropped and counted). Staleness per
  sample is then anywhere in [0, α], read from rollouts.jsonl.
* ``forced`` — every sample exactly α versions old (min(α, v) at version v): the
  synchronous colocated run with a generation server (``server_factory``, the
  runtime's injection point) that installs, at each publish of version v, the
  weights of version v - α. The engine samples and records behaviour logprobs
  under those old weights, so every loss sees the true behaviour policy; the
  runtime's own staleness metrics read 0 (the server reports the current
  version so that the α = 0 scheduler accepts the samples), and this benchmark
  records the true staleness itself. Nothing in the runtime changes.

Losses: ``--losses`` takes any name in ``POLICY_LOSSES`` (default ``ppo``
against behaviour, ``decoupled_ppo``, ``tis``, ``cispo``, ``m2po``, ``gspo``), each
at its own default hyper-parameters; the losses that need the proximal policy
(``policy_loss.PROXIMAL_LOSSES``: decoupled_ppo, tis and the rollout corrections)
run with ``learner.ratio_against=proximal``.
The quick grid runs ppo, decoupled_ppo and cispo for 40 steps (``GRIDS``).

Measured per run (read back from metrics.jsonl / rollouts.jsonl): training reward
against trained samples, held-out reward (``eval_accuracy``: the mean
``digit_match`` of the current policy on ``--eval_prompts`` held-out prompts)
against policy versions, the reward of the samples by the policy version that
generated them, staleness histogram, the token ESS (sum w)^2 / (N sum w^2) of
w = pi_theta / mu per step (``fresh_ess_token``, see ``experiment_class``), the
on-policy logprob gap and wall time. Summaries per (mode, α, loss), mean +- std over
seeds: held-out reward at equal trained samples (half-way and at the end), the
final reward, trained samples to reach ``--target`` held-out reward (never: inf),
staleness and ESS. Written: ``--out`` JSON (runs + summary), the printed table,
and PNG plots (``--plots`` directory).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)

from replay import apply_override, mean_std  # noqa: E402

DEFAULT_LOSSES = ("ppo", "decoupled_ppo", "tis", "cispo", "m2po", "gspo")
WORDS = ["<pad>", "<eos>", "=", "reverse", "sort", "copy"] + [str(d) for d in range(10)]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} ={% endif %}"
)
GRIDS: dict[str, dict[str, Any]] = {
    # 33 runs of 40 steps: 5 alphas x 3 losses x 2 seeds (sched) + forced alpha 4 x 3
    # losses x 1 seed. 34.5 min measured at load 8-16 (31-70 s a run); less on idle cores.
    "quick": dict(
        alphas=[0, 1, 2, 4, 8], losses=["ppo", "decoupled_ppo", "cispo"], seeds=2,
        modes=["sched", "forced"], steps=40, forced_alphas=[4], forced_seeds=1,
    ),
    # Every default loss, both modes, 3 seeds, 120 steps: 90 sched + 72 forced runs
    # (~5 h on 2 idle cores, estimated; see docs/STALENESS.md).
    "full": dict(
        alphas=[0, 1, 2, 4, 8], losses=list(DEFAULT_LOSSES), seeds=3,
        modes=["sched", "forced"], steps=120, forced_alphas=[1, 2, 4, 8], forced_seeds=3,
    ),
    # Seconds of steps (about a minute with start-up): the test's plumbing check.
    "smoke": dict(
        alphas=[0, 2], losses=["ppo"], seeds=1, modes=["sched", "forced"], steps=3,
        forced_alphas=[2], forced_seeds=1,
    ),
}  # fmt: skip


# ----------------------------------------------------------------------------- model


def digit_tokenizer():
    """The 16-word tokenizer of the digit tasks (WordLevel over whitespace-split words).

    Chat template: the user message, then `` =`` as the generation prompt
    ("reverse 3 1 4 =" is 5 tokens); eos ``<eos>`` (id 1), pad ``<pad>`` (id 0).
    """
    import tokenizers

    from jaxflash.models.text.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(
        [tokenizers.AddedToken(w, special=True, normalized=False) for w in WORDS[:2]]
    )
    return Tokenizer(
        tok,
        special_tokens={"eos_token": "<eos>", "pad_token": "<pad>"},
        chat_template=CHAT_TEMPLATE,
    )


def build_digit_model(directory: str, *, seed: int, max_seq_len: int = 64, **sizes: int) -> None:
    """Writes a random-init model of the real architecture with the digit tokenizer.

    Args:
      directory: HF output directory (model.safetensors, config.json, tokenizer files).
      seed: init seed.
      max_seq_len: positions served (prompt + response).
      **sizes: ModelConfig fields overriding the "tiny" preset (d_model, n_layers ...).
    """
    import jax
    import numpy as np

    from jaxflash.models.config.presets import get_preset
    from jaxflash.models.decoder.transformer import init_params
    from jaxflash.models.formats.weights_hf import save_hf

    tokenizer = digit_tokenizer()
    config = get_preset("tiny", vocab_size=tokenizer.vocab_size, max_seq_len=max_seq_len)
    config = config.replace(**sizes)
    params = jax.tree.map(np.array, jax.device_get(init_params(config, seed)))
    save_hf(directory, config, params, tokenizer)


# ----------------------------------------------------------------------------- configs


def make_config(
    args: argparse.Namespace, model_dir: str, *, mode: str, alpha: int, loss: str, seed: int
) -> Any:
    """The experiment ConfigDict of one run (validated by ``ExperimentConfig``)."""
    import ml_collections

    from configs import rlvr_smollm2_arith

    c = rlvr_smollm2_arith.get_config()
    c.seed = seed
    c.total_steps = args.steps
    c.model.source, c.model.path = "hf", model_dir
    c.model.remat = False
    c.model.logits_chunk = 16
    c.data.task = "digits"
    c.data.task_options = json.dumps({"op": args.op, "length": args.length})
    c.data.eval_size = args.eval_prompts
    c.eval.samples_per_prompt = 1
    c.eval.every = max(1, args.steps // args.evals)
    c.checkpoint.every = args.steps  # one save, at the end
    c.checkpoint.max_to_keep = 1
    r = c.rollout
    r.prompts_per_step, r.group_size = args.prompts, args.group
    r.max_new_tokens = args.length  # exactly the answer's length; truncation keeps reward
    r.truncation = "none"
    r.temperature = 1.0
    r.num_slots = args.prompts * args.group
    c.learner.lr = args.lr
    c.learner.entropy_coef = args.entropy_coef
    c.learner.micro_batch_size = args.prompts * args.group
    c.learner.loss = loss
    c.learner.loss_kwargs = ml_collections.ConfigDict()  # each loss at its own defaults
    from jaxflash.algorithms.policy_loss import PROXIMAL_LOSSES

    c.learner.ratio_against = "proximal" if loss in PROXIMAL_LOSSES else "behaviour"
    c.reward.num_workers = 1
    c.mesh.num_cpu_devices = 2
    c.mesh.learner = ml_collections.ConfigDict({"fsdp": 1, "tensor": 1})  # device 0 always
    c.mesh.generation = ml_collections.ConfigDict({"tensor": 1})
    sched_async = mode == "sched" and alpha > 0
    c.mesh.colocated = not sched_async
    c.mesh.num_generation_slices = 1
    r.async_ratio = alpha if sched_async else 0
    for item in args.set:
        apply_override(c, item)
    return c


def experiment(c: Any) -> Any:
    """The run's validated experiment (``ExperimentWithImportance``)."""
    return experiment_class().from_config_dict(c)


_EXPERIMENT_CLASS: list[type] = []


def experiment_class() -> type:
    """``ExperimentConfig`` whose learner also reports the importance statistics of its rows.

    The learner computes ``fresh_ess_token`` / ``fresh_ess_seq`` / ``fresh_ratio_*``
    (w = pi_theta / mu at the step's params, ``learner.cycles.importance_metrics``)
    only on its dual-cycle path, which a run without replay does not take. This
    subclass sets ``learner.replay_loss`` to the run's own loss (kwargs,
    ratio_against) after validation, so the learner takes that path: no row is
    replayed (every row is labelled fresh and trained with ``learner.loss`` as
    before; ``learner.cycles`` documents the two paths as equal for fresh rows),
    only the metrics are added. A subclass rather than a one-off edit because the
    runtime copies the experiment (``dataclasses.replace``, which validates again).
    """
    if _EXPERIMENT_CLASS:
        return _EXPERIMENT_CLASS[0]
    from jaxflash.runtime.config.experiment import ExperimentConfig

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ExperimentWithImportance(ExperimentConfig):
        def __post_init__(self) -> None:
            super().__post_init__()
            lc = self.learner
            if lc.replay_loss is None:
                lc = lc.replace(
                    replay_loss=lc.loss,
                    replay_loss_kwargs=dict(lc.loss_kwargs),
                    replay_ratio_against=lc.ratio_against,
                )
                object.__setattr__(self, "learner", lc)

    _EXPERIMENT_CLASS.append(ExperimentWithImportance)
    return ExperimentWithImportance


def lagged_server_factory(lag: int):
    """``server_factory`` for ``rlvr.run``: a GenerationServer that, when handed version v,
    installs the weights of version max(0, v - lag) (under the label v)."""
    from jaxflash.runtime.fleet.gen_server import GenerationServer

    class LaggedServer(GenerationServer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._history = collections.deque([a[2]], maxlen=lag + 1)  # params by version

        def update_weights(self, params: Any, version: int) -> None:
            self._history.append(params)
            super().update_weights(self._history[0], version)

    return LaggedServer


# ----------------------------------------------------------------------------- reading runs


def _jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def ess_of(m: dict[str, Any]) -> float:
    """The step's token ESS of the importance weights, (sum w)^2 / (n sum w^2), in (0, 1]:
    the first of ``ess_token`` / ``is_ess_token`` / ``*_ess_token`` the row has (NaN: none)."""
    for key in ("fresh_ess_token", "ess_token"):
        if key in m:
            return float(m[key])
    for key, value in sorted(m.items()):
        if key.endswith("ess_token") and not key.startswith("replay"):
            return float(value)
    return math.nan


def read_run(workdir: str, *, mode: str, alpha: int) -> dict[str, Any]:
    """Curves and distributions of one finished run.

    Returns:
      {"steps": [{step, trained, reward, staleness_mean, ess, gap}], "evals": [{step,
      trained, reward, stderr}], "by_version": {version: mean reward of the trained
      samples it generated}, "staleness_hist": {staleness: samples}, "dropped_stale"}.
      In ``forced`` mode the staleness is the true one, min(alpha, version).
    """
    metrics = _jsonl(os.path.join(workdir, "metrics.jsonl"))
    rollouts = _jsonl(os.path.join(workdir, "rollouts.jsonl"))
    steps, evals, trained = [], [], 0
    for m in metrics:
        step = int(m["step"])
        if step:
            trained += int(m.get("num_samples", 0))
            steps.append(
                {
                    "step": step,
                    "trained": trained,
                    "reward": float(m.get("reward_mean", math.nan)),
                    "staleness_mean": float(m.get("staleness_mean", math.nan)),
                    "ess": ess_of(m),
                    # max |log pi - log mu| over tokens the runtime counts as on-policy:
                    # rounding (~1e-5) in sched mode, the lag's policy change in forced mode
                    "gap": float(m.get("logprob_gap_on_policy_max", math.nan)),
                }
            )
        if "eval_accuracy" in m:
            evals.append(
                {
                    "step": step,
                    "trained": trained,
                    "reward": float(m["eval_accuracy"]),
                    "stderr": float(m.get("eval_accuracy_stderr", math.nan)),
                }
            )
    by_version: dict[int, list[float]] = collections.defaultdict(list)
    hist: collections.Counter = collections.Counter()
    dropped = 0
    for row in rollouts:
        if row["outcome"] == "stale":
            dropped += 1
        if row["outcome"] != "trained" or row["reward"] is None:
            continue
        version = row["learner_step"] - 1
        stale = min(alpha, version) if mode == "forced" else int(row["staleness"])
        behaviour = version - stale
        by_version[behaviour].append(float(row["reward"]))
        hist[stale] += 1
    if mode == "forced":
        for s in steps:
            s["staleness_mean"] = float(min(alpha, s["step"] - 1))
    return {
        "steps": steps,
        "evals": evals,
        "by_version": {str(v): sum(r) / len(r) for v, r in sorted(by_version.items())},
        "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
        "dropped_stale": dropped,
    }


# ----------------------------------------------------------------------------- grid


def grid_runs(args: argparse.Namespace) -> list[tuple[str, int, str, int]]:
    """(mode, alpha, loss, seed) of every run, in run order: seed by seed (a grid cut
    short still has whole seeds), a seed's forced runs after its sched runs."""
    out = []
    for seed in range(max(args.seeds, args.forced_seeds)):
        if "sched" in args.modes and seed < args.seeds:
            for loss in args.losses:
                out += [("sched", a, loss, seed) for a in args.alphas]
        if "forced" in args.modes and seed < args.forced_seeds:
            for loss in args.losses:
                out += [("forced", a, loss, seed) for a in args.forced_alphas if a > 0]
    return out


def save(args: argparse.Namespace, runs: list[dict[str, Any]], *, partial: bool) -> dict:
    """Writes ``args.out`` (after every run: a grid cut short keeps what it ran)."""
    hidden = ("workdir", "out", "plots", "summarize")
    out = {
        "args": {k: v for k, v in vars(args).items() if k not in hidden},
        "partial": partial,
        "summary": summarize(runs, args.target),
        "runs": runs,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return out


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the grid, through ``runtime.loop.run``; their curves and facts."""
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxflash.runtime import loop as rlvr

    model_dir = os.path.join(args.workdir, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_digit_model(model_dir, seed=0, **args.model_sizes)
    runs = []
    plan = grid_runs(args)
    for i, (mode, alpha, loss, seed) in enumerate(plan):
        c = make_config(args, model_dir, mode=mode, alpha=alpha, loss=loss, seed=seed)
        exp = experiment(c)
        workdir = os.path.join(args.workdir, f"{mode}_a{alpha}_{loss}_s{seed}")
        kwargs = {"server_factory": lagged_server_factory(alpha)} if mode == "forced" else {}
        t0 = time.monotonic()
        last = rlvr.run(exp, workdir=workdir, **kwargs)
        wall = time.monotonic() - t0
        run = {
            "mode": mode,
            "alpha": alpha,
            "loss": loss,
            "ratio_against": exp.learner.ratio_against,
            "seed": seed,
            "wall_s": wall,
            "load": os.getloadavg(),
            "policy_version": int(last.get("policy_version", args.steps)),
            **read_run(workdir, mode=mode, alpha=alpha),
        }
        runs.append(run)
        save(args, runs, partial=i + 1 < len(plan))
        ev = run["evals"]
        print(
            f"[{i + 1}/{len(plan)}] {mode} alpha={alpha} {loss} seed {seed}: "
            f"{wall:.0f} s, held-out reward {ev[0]['reward']:.3f} -> {ev[-1]['reward']:.3f}, "
            f"staleness {run['staleness_hist']}, dropped stale {run['dropped_stale']}, "
            f"load {tuple(round(x, 1) for x in run['load'])}",
            flush=True,
        )
    return runs


# ----------------------------------------------------------------------------- summary


def _at(evals: list[dict[str, Any]], trained: float) -> float:
    """Held-out reward of the last evaluation at or before ``trained`` samples."""
    got = [e["reward"] for e in evals if e["trained"] <= trained]
    return got[-1] if got else math.nan


def _mean(xs: list[float]) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else math.nan


def summarize(runs: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """One row per (mode, alpha, loss): per-seed values and their mean/std."""
    groups: dict[tuple, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in runs:
        groups[(r["mode"], r["alpha"], r["loss"])].append(r)
    rows = []
    for (mode, alpha, loss), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0] != "sched", kv[0][2], kv[0][1])
    ):
        total = min(r["evals"][-1]["trained"] for r in rs)
        half = total / 2
        hist: collections.Counter = collections.Counter()
        for r in rs:
            hist.update({int(k): v for k, v in r["staleness_hist"].items()})
        n = sum(hist.values())
        rows.append(
            {
                "mode": mode,
                "alpha": alpha,
                "loss": loss,
                "seeds": len(rs),
                "trained_samples": total,
                "reward_half": [_at(r["evals"], half) for r in rs],
                "reward_final": [_at(r["evals"], total) for r in rs],
                "train_reward_last": [
                    _mean([s["reward"] for s in r["steps"][-max(1, len(r["steps"]) // 10) :]])
                    for r in rs
                ],
                "samples_to_target": [
                    next(
                        (e["trained"] for e in r["evals"] if e["step"] and e["reward"] >= target),
                        math.inf,
                    )
                    for r in rs
                ],
                "staleness_mean": sum(k * v for k, v in hist.items()) / n if n else math.nan,
                "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
                "ess_mean": _mean([_mean([s["ess"] for s in r["steps"]]) for r in rs]),
                "ess_min": min(
                    (s["ess"] for r in rs for s in r["steps"] if math.isfinite(s["ess"])),
                    default=math.nan,
                ),
                "dropped_stale": [r["dropped_stale"] for r in rs],
                "wall_s": [r["wall_s"] for r in rs],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], target: float) -> None:
    print(
        f"\nheld-out reward (mean +- std over seeds) at half and all of the trained samples; "
        f"k samples to target = thousands of trained samples until held-out reward >= "
        f"{target:g}; stale = mean staleness; ESS = mean token ESS of pi/mu"
    )
    head = (
        f"{'mode':<7}{'alpha':>5}  {'loss':<14}{'reward @ half':>16}{'reward @ end':>16}"
        f"{'k samples to target':>30}{'stale':>7}{'ESS':>7}{'dropped':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['mode']:<7}{r['alpha']:>5}  {r['loss']:<14}{mean_std(r['reward_half']):>16}"
            f"{mean_std(r['reward_final']):>16}"
            f"{mean_std([x / 1000 for x in r['samples_to_target']]):>30}"
            f"{r['staleness_mean']:>7.2f}{r['ess_mean']:>7.3f}{sum(r['dropped_stale']):>9}"
        )
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")


# ----------------------------------------------------------------------------- plots


def plot(runs: list[dict[str, Any]], rows: list[dict[str, Any]], directory: str) -> list[str]:
    """PNG plots into ``directory``; returns their paths. One figure per mode: a panel per
    loss, held-out reward vs trained samples (mean over seeds, band = min..max) per alpha;
    the training reward by behaviour version; and the staleness histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    modes = sorted({r["mode"] for r in runs}, key=lambda m: m != "sched")
    losses = list(dict.fromkeys(r["loss"] for r in runs))
    cmap = plt.get_cmap("viridis")
    alphas_all = sorted({r["alpha"] for r in runs})
    color = {a: cmap(i / max(1, len(alphas_all) - 1)) for i, a in enumerate(alphas_all)}
    for mode in modes:
        fig, axes = plt.subplots(2, len(losses), figsize=(4 * len(losses), 7), squeeze=False)
        for j, loss in enumerate(losses):
            ax, bx = axes[0][j], axes[1][j]
            # sync (sched, alpha 0) is the reference on every panel
            shown = [
                r
                for r in runs
                if r["loss"] == loss
                and (r["mode"] == mode or (r["mode"] == "sched" and r["alpha"] == 0))
            ]
            for alpha in sorted({r["alpha"] for r in shown}):
                rs = [r for r in shown if r["alpha"] == alpha and (r["mode"] == mode or alpha == 0)]
                n = min(len(r["evals"]) for r in rs)
                x = [rs[0]["evals"][k]["trained"] for k in range(n)]
                ys = [[r["evals"][k]["reward"] for r in rs] for k in range(n)]
                ax.plot(x, [sum(y) / len(y) for y in ys], color=color[alpha], label=f"α={alpha}")
                ax.fill_between(
                    x, [min(y) for y in ys], [max(y) for y in ys], color=color[alpha], alpha=0.2
                )
                by = collections.defaultdict(list)
                for r in rs:
                    for v, rew in r["by_version"].items():
                        by[int(v)].append(rew)
                vs = sorted(by)
                bx.plot(
                    vs,
                    [sum(by[v]) / len(by[v]) for v in vs],
                    color=color[alpha],
                    label=f"α={alpha}",
                )
            ax.set_title(f"{loss} ({mode})")
            ax.set_xlabel("trained samples")
            ax.set_ylabel("held-out reward")
            ax.legend(fontsize=7)
            bx.set_xlabel("policy version that generated the samples")
            bx.set_ylabel("training reward")
        fig.tight_layout()
        path = os.path.join(directory, f"staleness_reward_{mode}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for r in rows:
        if r["mode"] != "sched" or r["alpha"] == 0:
            continue
        h = {int(k): v for k, v in r["staleness_hist"].items()}
        n = sum(h.values())
        ks = sorted(h)
        axes[0].plot(
            ks,
            [h[k] / n for k in ks],
            marker="o",
            color=color[r["alpha"]],
            alpha=0.6,
            label=f"α={r['alpha']} {r['loss']}",
        )
    axes[0].set_xlabel("staleness (versions)")
    axes[0].set_ylabel("share of trained samples")
    axes[0].set_title("staleness (sched mode)")
    axes[0].legend(fontsize=6)
    for r in runs:
        if r["mode"] != "sched":
            continue
        xs = [s["trained"] for s in r["steps"] if math.isfinite(s["ess"])]
        ys = [s["ess"] for s in r["steps"] if math.isfinite(s["ess"])]
        axes[1].plot(xs, ys, color=color[r["alpha"]], alpha=0.4, lw=0.8)
    axes[1].set_xlabel("trained samples")
    axes[1].set_ylabel("token ESS")
    axes[1].set_title("ESS per step (sched mode; colour = α)")
    fig.tight_layout()
    path = os.path.join(directory, "staleness_distributions.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)
    return paths


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxflash.algorithms.policy_loss import POLICY_LOSSES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", choices=["quick", "full"], default="quick")
    p.add_argument("--smoke", action="store_true", help="3 tiny runs (plumbing only)")
    p.add_argument("--losses", nargs="+", default=None, help=f"any of {sorted(POLICY_LOSSES)}")
    p.add_argument(
        "--alphas", nargs="+", type=int, default=None, help="sched-mode alphas (0 = sync)"
    )
    p.add_argument("--forced_alphas", nargs="+", type=int, default=None)
    p.add_argument("--modes", nargs="+", choices=["sched", "forced"], default=None)
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--forced_seeds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="learner steps per run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (B)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--length", type=int, default=2, help="digits per problem")
    p.add_argument("--op", default="reverse", choices=["reverse", "sort", "copy"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--evals", type=int, default=8, help="evaluations per run (plus step 0)")
    p.add_argument("--eval_prompts", type=int, default=64)
    p.add_argument("--target", type=float, default=0.5, help="held-out reward target")
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--entropy_coef", type=float, default=0.02, help="learner.entropy_coef")
    p.add_argument(
        "--summarize", default="", metavar="JSON", help="no runs: table and plots of a results JSON"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config field for every run, e.g. learner.lr=1e-3 (repeatable)",
    )
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    p.add_argument("--out", default="", help="results JSON (default: <workdir>/staleness.json)")
    p.add_argument("--plots", default="", help="PNG directory (default: <workdir>/plots)")
    args = p.parse_args(argv)  # fmt: skip
    grid = GRIDS["smoke" if args.smoke else args.grid]
    for key, value in grid.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.prompts, args.group, args.eval_prompts, args.evals = 2, 2, 4, 1
    unknown = [name for name in args.losses if name not in POLICY_LOSSES]
    if unknown:
        p.error(f"--losses {unknown}: not in POLICY_LOSSES {sorted(POLICY_LOSSES)}")
    if any(a < 0 for a in args.alphas + args.forced_alphas):
        p.error("--alphas / --forced_alphas must be >= 0")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    args.model_sizes = {"d_model": args.d_model, "n_layers": args.n_layers}
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="staleness_")
    args.out = args.out or os.path.join(args.workdir, "staleness.json")
    args.plots = args.plots or os.path.join(args.workdir, "plots")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.summarize:
        with open(args.summarize, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
        rows = summarize(runs, args.target)
        print_table(rows, args.target)
        print("wrote " + ", ".join(plot(runs, rows, args.plots)))
        return {"summary": rows, "runs": runs}
    print(f"load average at start (1, 5, 15 min): {os.getloadavg()}; runs in {args.workdir}")
    t0 = time.monotonic()
    runs = run_grid(args)
    out = save(args, runs, partial=False)
    print_table(out["summary"], args.target)
    paths = plot(runs, out["summary"], args.plots)
    print(f"wrote {args.out} and {', '.join(paths)}; {(time.monotonic() - t0) / 60:.1f} min")
    return out


if __name__ == "__main__":
    main()
