"""The simulator's cost model from a plan's compiled programs (roofline seconds).

``program_times`` turns each program of a ``sizing.plan.Plan`` into seconds on a
chip -- max(FLOPs / peak, bytes / HBM bandwidth), a lower bound that ignores ICI
collectives, latency and host overhead -- and ``cost_model`` into a
``runtime.simulate.CostModel``:

- train step: the ``train_step`` roofline over its [B, T] tokens, per token, on the
  config's learner chips; other learner sizes scale it linearly (the simulator's
  ``LearnerCost``), and a step trains the batch's rows padded to its longest
  sequence (or its real tokens with ``learner.packing``).
- prefill: a least-squares line through the ``prefill_<bucket>`` rooflines (seconds
  vs bucket tokens): per prompt and per prompt token.
- decode step as a function of live slots: ``base + per_live_slot x live``. On the
  reference path (pure-JAX gather) and with a dense cache a step reads every slot's
  reservation, so it costs the compiled step at any live count. On the kernel path
  the compiled step's bytes (its HBM walk, ``sizing.hbm_traffic``, else XLA's count)
  miss the kernel's KV reads (``sizing.kv_pool``): each live slot adds its K/V at the
  mean live context, on paper.
- publish: the ``publish`` and ``install`` rooflines plus the copy of one generation
  chip's weights over ICI (at half the chip's published bidirectional bandwidth; left
  out for a chip without that figure). Generation waits for it.
- reward: instant (rule-based verifiers on host workers).

``assumed_workload`` states the response lengths assumed (a config fixes only the
budget).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflash.runtime.simulate.costs import (
    CostModel,
    DecodeCost,
    LearnerCost,
    PrefillCost,
    RewardCost,
    SyncCost,
)
from jaxflash.runtime.simulate.workload import LogNormal, SimWorkload
from jaxflash.sizing.chips import ChipSpec, roofline_seconds
from jaxflash.sizing.plan import Plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunShape:
    """The run's placement and workload as its config gives them.

    Attributes:
      slice_chips: chips of the slice (the topology).
      learner_chips: the config's learner chips (where ``train_step`` was compiled).
      gen_chips: chips of one generation slice (server).
      slots: decode slots per server.
      prompts_per_step, group_size: B prompts x G samples per learner step.
      prompt_tokens: the prompt limit (``rollout.max_prefill_length``).
      max_new_tokens: the response budget.
      async_ratio: α of the async figure (the config's, or 2 where it says 0).
      packing: ``learner.packing`` (the learner trains real tokens, not padded rows).
      micro_batch_size: ``learner.micro_batch_size``.
      seq_len: T of the compiled train step (prompt limit + budget).
      hbm_bytes: usable HBM per chip.
    """

    slice_chips: int
    learner_chips: int
    gen_chips: int
    slots: int
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    max_new_tokens: int
    async_ratio: int
    packing: bool
    micro_batch_size: int
    seq_len: int
    hbm_bytes: int

    @property
    def batch(self) -> int:
        return self.prompts_per_step * self.group_size


def assumed_workload(shape: RunShape, seed: int = 0) -> tuple[SimWorkload, str]:
    """The response lengths the forecast assumes (a config fixes only the budget).

    Lognormal, median an eighth of the budget (σ 1.0; a per-prompt scale
    σ_p 0.5: hard prompts are long for every sample), capped at ``max_new_tokens``;
    prompts of half the prompt limit. Returns (workload, one line saying so).
    """
    median = max(1.0, shape.max_new_tokens / 8)
    prompt = max(1, shape.prompt_tokens // 2)
    work = SimWorkload(
        lengths=LogNormal(median=median, sigma=1.0),
        max_tokens=shape.max_new_tokens,
        prompt_tokens=(prompt,),
        prompt_sigma=0.5,
        seed=seed,
    )
    lens = _sample_lengths(work, shape)
    capped = float(np.mean(lens >= shape.max_new_tokens))
    line = (
        f"workload (assumed; the config fixes B, G and the budget, not the lengths): "
        f"{shape.prompts_per_step} prompts x {shape.group_size} samples a step, prompts of "
        f"{prompt} tokens, responses lognormal median {median:.0f} tokens, sigma 1.0, "
        f"per-prompt sigma 0.5, capped at {shape.max_new_tokens} (mean {lens.mean():.0f}, "
        f"{100 * capped:.1f} % capped)"
    )
    return work, line


def _sample_lengths(work: SimWorkload, shape: RunShape, prompts: int = 256) -> np.ndarray:
    return np.asarray(
        [work.response_len(p, i) for p in range(prompts) for i in range(shape.group_size)], float
    )


def mean_live_context(work: SimWorkload, shape: RunShape) -> float:
    """Tokens of context a live slot holds, averaged over decode steps: a sample of r
    tokens is live r steps at contexts P+1..P+r, so Σ r(P + (r+1)/2) / Σ r."""
    r = _sample_lengths(work, shape)
    p = work.prompt_len(0)
    return float(np.sum(r * (p + (r + 1) / 2)) / np.sum(r))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramTimes:
    """Seconds per program from the roofline (what the CostModel is built from).

    Attributes:
      train_step_s: the compiled step over ``train_tokens`` on the learner chips.
      train_tokens: B x T of the compiled step.
      prefill_base_s, prefill_token_s: a prefill call: base + per bucket token.
      decode_base_s: a decode step's cost at any live count.
      decode_live_s: added per live slot (kernel path: its KV at the mean context).
      publish_s, install_s, transfer_s: the weight hand-over's parts.
      path: how the decode step was priced.
    """

    train_step_s: float
    train_tokens: int
    prefill_base_s: float
    prefill_token_s: float
    decode_base_s: float
    decode_live_s: float
    publish_s: float
    install_s: float
    transfer_s: float
    path: str

    @property
    def sync_s(self) -> float:
        return self.publish_s + self.install_s + self.transfer_s


def program_times(
    plan: Plan,
    chip: ChipSpec,
    shape: RunShape,
    *,
    context_tokens: float,
    kernel_what_if: bool = False,
    share: int = 1,
) -> ProgramTimes:
    """Roofline seconds of each program of ``plan`` on ``chip`` (see the module doc).

    Args:
      plan: from ``sizing.plan.plan_programs``.
      chip: the chip's figures.
      shape: the run (the compiled train step is [B, T] = shape.batch x shape.seq_len).
      context_tokens: mean live context of a slot (``mean_live_context``).
      kernel_what_if: price the decode step as the TPU kernel over a pool split over
        every chip of the generation slice would run it (page-split pool): weights on
        paper, plus each live slot's KV, instead of the compiled path.
      share: devices per chip (2 on v4, where each TensorCore is a device).

    Raises:
      ValueError: a program the forecast needs is missing or was refused.
    """
    by = plan.by_name()
    decode = [c for c in plan.costs if c.name.startswith("decode_block")]
    missing = [n for n in ("train_step", "publish", "install") if n not in by]
    missing += [] if len(decode) == 1 else ["decode_block"]
    refused = [c.name for c in plan.costs if c.refused]
    if missing or refused:
        raise ValueError(
            f"forecast: needs every program compiled; missing {missing}, refused {refused}"
        )

    def roof(c) -> float:
        return roofline_seconds(c.flops + c.unseen_flops, c.traffic_bytes, chip, share=share)

    prefill = sorted(
        (int(c.name.split("_")[1]), roof(c)) for c in plan.costs if c.name.startswith("prefill_")
    )
    base = slope = 0.0
    if len(prefill) > 1:
        slope, base = np.polyfit([b for b, _ in prefill], [t for _, t in prefill], 1)
    elif prefill:
        slope = prefill[0][1] / prefill[0][0]
    block, steps, kv = decode[0], plan.decode_steps, plan.kv
    bandwidth = chip.hbm_bandwidth / share
    if kernel_what_if:
        step = roofline_seconds(block.flops / steps, plan.engine_weight_bytes, chip, share=share)
        live = context_tokens * kv.token_bytes / block.devices / bandwidth
        path = "kernel what-if"
    elif kv.attention == "tpu_kernel":
        counted = block.hbm_bytes if block.hbm_bytes > 0 else block.bytes_accessed
        step = roofline_seconds(block.flops / steps, counted / steps, chip, share=share)
        live = context_tokens * kv.token_chip_bytes / bandwidth
        path = kv.attention
    else:
        step, live, path = roof(block) / steps, 0.0, kv.attention
    ici = chip.ici_bandwidth / 2 / share
    return ProgramTimes(
        train_step_s=roof(by["train_step"]), train_tokens=shape.batch * shape.seq_len,
        prefill_base_s=max(0.0, float(base)), prefill_token_s=max(0.0, float(slope)),
        decode_base_s=step, decode_live_s=live,
        publish_s=roof(by["publish"]), install_s=roof(by["install"]),
        transfer_s=plan.engine_weight_bytes / ici if ici else 0.0, path=path,
    )  # fmt: skip


def cost_model(times: ProgramTimes, shape: RunShape, chip: ChipSpec) -> CostModel:
    """The simulator's CostModel from the program times (see the module doc)."""
    return CostModel(
        name=f"roofline of the compiled programs on {chip.kind} (model figures)",
        decode=DecodeCost(base_s=times.decode_base_s, per_active_slot_s=times.decode_live_s),
        prefill=PrefillCost(per_prompt_s=times.prefill_base_s,
                            per_prompt_token_s=times.prefill_token_s),
        learner=LearnerCost(
            step_s=0.0, per_token_s=times.train_step_s / times.train_tokens,
            padding="packed" if shape.packing else "bucket",
            reference_devices=shape.learner_chips,
        ),
        sync=SyncCost(weight_sync_s=times.sync_s, colocated_s=times.publish_s + times.install_s,
                      stalls_generation=True),
        reward=RewardCost(latency_s=0.0, workers=1),
        server_devices=shape.gen_chips,
        meta={"source": "jaxflash.runtime.simulate.forecast: roofline of the compiled programs"},
    )  # fmt: skip
