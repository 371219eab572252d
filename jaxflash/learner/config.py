"""Learner configuration: optimiser, schedule, micro-batching and loss choice.

The ConfigDict stops at the launcher; the learner only ever sees this frozen,
validated dataclass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from jaxflash.algorithms.aggregation import AGGREGATION_MODES
from jaxflash.algorithms.loss_hparams import check_loss_hparams
from jaxflash.algorithms.policy_loss import POLICY_LOSSES, PROXIMAL_LOSSES
from jaxflash.learner.packing import check_packing
from jaxflash.models.adapters.lora import LoraConfig
from jaxflash.types import SamplingParams

SCHEDULES = ("constant", "cosine")
RATIO_AGAINST = ("behaviour", "proximal")


def _check_loss(field: str, loss: str, kwargs: Any, ratio_against: str) -> None:
    """Checks a loss name, its keyword hyper-parameters and its pi_old (naming ``field``).

    Raises:
      ValueError: an unknown loss or ratio_against, kwargs the loss does not take or
        of a wrong type or range (``loss_hparams``), or decoupled_ppo / tis / a
        rollout correction (``rollout_correction``) without ratio_against="proximal".
    """
    against = "ratio_against" if field == "loss" else f"{field.removesuffix('_loss')}_ratio_against"
    if loss not in POLICY_LOSSES:
        raise ValueError(
            f"LearnerConfig.{field} must be one of {sorted(POLICY_LOSSES)}, got {loss!r}"
        )
    if ratio_against not in RATIO_AGAINST:
        raise ValueError(
            f"LearnerConfig.{against} must be one of {RATIO_AGAINST}, got {ratio_against!r}"
        )
    if loss in PROXIMAL_LOSSES and ratio_against != "proximal":
        # Against mu itself the behaviour weight pi_prox/mu is identically 1:
        # the off-policy correction would silently vanish.
        raise ValueError(
            f"LearnerConfig.{field}={loss!r} needs {against}='proximal', got {ratio_against!r}"
        )
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"LearnerConfig.{field}_kwargs must be a mapping, got {type(kwargs)}")
    # Names, types and ranges now, not at the first train step's trace.
    check_loss_hparams(loss, kwargs, where=f"LearnerConfig.{field}_kwargs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """How the learner turns a TrainBatch into a parameter update.

    Attributes:
      lr: peak learning rate (after warmup).
      warmup_steps: linear warmup from 0 to ``lr`` over this many optimiser steps.
      schedule: "constant" (lr after warmup) or "cosine" (decays to
        ``lr * min_lr_ratio`` at ``total_steps``).
      total_steps: optimiser steps of the run; required by "cosine".
      min_lr_ratio: floor of the cosine schedule as a fraction of ``lr``.
      weight_decay: decoupled (AdamW) weight decay, applied to matrices only
        (not to norms or biases).
      b1, b2, eps: Adam moments' decay rates and denominator epsilon.
      grad_clip_norm: clip the global gradient norm to this; 0 disables.
      micro_batch_size: sequences per micro-batch (gradient accumulation unit).
      loss: policy loss name in ``jaxflash.algorithms.policy_loss.POLICY_LOSSES``
        ("ppo", "decoupled_ppo", "tis", "cispo", "gspo", ...).
      loss_kwargs: keyword hyper-parameters of that loss (e.g. ppo's
        ``clip_eps_low``/``clip_eps_high``).
      ratio_against: what pi_old in r = pi/pi_old is. "behaviour": the engine's
        logprobs mu (plain off-policy PPO). "proximal": the params at the start
        of this step (AReaL's proximal policy, arXiv 2505.24298); with one
        optimiser step per batch that is the current params, so pi_old =
        stop_gradient(log pi) exactly and mu enters as ``behaviour_logp_bt``
        (required by "decoupled_ppo" and "tis").
      aggregation: loss aggregation mode of ``jaxflash.algorithms.aggregation``
        (e.g. "token-mean"); it is normalised by whole-batch counts so it does
        not depend on the micro-batch split.
      aggregation_max_tokens: the constant length normaliser of
        "seq-mean-token-sum-norm" (Dr. GRPO: the generation budget).
      kl_coef: weight of the k3 KL estimate to reference params; 0 disables (and
        no reference params are held).
      entropy_coef: weight of an entropy bonus (loss -= coef * entropy); 0 disables.
      sampling: temperature / top-k / top-p the generator samples with; the
        learner rescores under the same processed distribution.
      logprob_chunk: tokens per chunk of the chunked log-softmax (bounds the
        [b, chunk, V] logits alive at once).
      replay_loss: the dual replay cycle (ReFlow; ``learner.cycles``): the
        ``POLICY_LOSSES`` name applied to rows labelled replayed
        (``TrainBatch.cycle_bt == 1``) while ``loss`` applies to fresh rows, in the
        same jitted step; the step then also reports importance-ratio statistics
        and ESS per cycle. None (default): batches have no replayed rows (one with
        any is refused) and one loss applies to every row. Runs set it from
        ``replay.*`` (``runtime.config.replay_spec``).
      replay_loss_kwargs: hyper-parameters of ``replay_loss``.
      replay_ratio_against: pi_old of the replayed rows, as ``ratio_against``
        ("proximal" for "decoupled_ppo" / "tis": AReaL's decoupled objective with
        the stored behaviour logprobs as mu; "behaviour": clip or weight against the
        stored behaviour logprobs themselves, as RePO / CISPO / M2PO do).
      router_aux_loss_coef: weight of the mixture-of-experts load-balancing loss
        (``models.decoder.moe.load_balancing_loss``, Switch arXiv 2101.03961, as transformers'
        Qwen3-MoE computes it) over the loss-masked tokens, added to the loss and
        reported as ``router_aux_loss``; needs a model with experts. 0 (default)
        disables it, as transformers does unless ``output_router_logits`` (the
        checkpoint's own ``ModelConfig.router_aux_loss_coef`` is not applied). With
        more than one micro-batch it costs one extra forward pass per step (the
        batch's expert loads, so the loss stays micro-batch invariant).
      router_replay: router replay (R3, arXiv 2510.11370) for mixture-of-experts
        models: the forward sends each token to the experts the engine routed it to
        (``Sample.routed_experts``, carried as ``TrainBatch.routed_experts_btlk``),
        weighted by the live router's probabilities of those experts (renormalised
        as ``ModelConfig.norm_topk_prob`` says), so the router keeps its gradient;
        tokens without a recorded route route live. False (default): the learner
        routes every token itself. Either way a batch with routes reports
        ``router_mismatch_frac``. Needs a model with experts; samples from the slot
        loop's engine carry routes (JetStream's serving path records none).
      lora: low-rank adapters over a frozen base (``models.adapters.lora.LoraConfig``;
        docs/LORA.md): only the adapters train, hold optimizer state and are published; the KL
        reference is the base without adapters. None: full fine-tuning.
      packing: the step packs a [B, T] batch's sequences end to end into rows of
        ``pack_length`` tokens with segment ids (``learner.packing``) instead of one
        padded row each; ``micro_batch_size`` then counts packed rows. Needs a
        token-level loss and an aggregation without per-row lengths
        (``packing.check_packing``). Logprobs equal the unpacked ones.
      prefix_sharing: with ``packing``: the samples of one prompt (rows whose tokens
        before the first loss target are identical) share one copy of the prompt in
        their packed row (``packing.pack_groups``): its forward and backward run once
        per group instead of once per sample. Logprobs equal the unpacked ones up to
        float summation order (not bitwise: refused with ``model.exact_numerics``;
        refused for sliding-window models and ``model.attention="splash"`` when the
        learner is built; "auto" takes blockwise attention instead of splash on TPU,
        ``scoring.prefix_sharing_model``).
        On GRPO batches of G samples per prompt this removes (G - 1) prompts' worth
        of learner work per group (benchmarks/e2e_vs_tunix.py, docs/PERF.md).
      pack_length: tokens per packed row where longer than the batch's T (its longest
        sequence's bucket); 0: T. Each distinct (rows, length) compiles once.
      length_multiple: the batch's T is its longest sequence rounded up to a multiple
        of this (``learner.batching.bucket_length``). Each distinct T compiles the step
        once: 32 keeps the compiles few when lengths vary; a short job whose rows are
        all about one length pads less with 8 (70 tokens: T 72 instead of 96, 1.33x
        less learner work; benchmarks/e2e_vs_tunix.py).
    """

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    micro_batch_size: int = 8
    loss: str = "ppo"
    loss_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    ratio_against: str = "behaviour"
    aggregation: str = "token-mean"
    aggregation_max_tokens: int | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    logprob_chunk: int = 256
    replay_loss: str | None = None
    replay_loss_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    replay_ratio_against: str = "behaviour"
    router_aux_loss_coef: float = 0.0
    router_replay: bool = False
    lora: LoraConfig | None = None
    packing: bool = False
    prefix_sharing: bool = False
    pack_length: int = 0
    length_multiple: int = 32

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"LearnerConfig.lr must be finite and >= 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"LearnerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"LearnerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}"
            )
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                "LearnerConfig.total_steps must exceed warmup_steps for the cosine schedule, "
                f"got total_steps={self.total_steps}, warmup_steps={self.warmup_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"LearnerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"LearnerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"LearnerConfig.{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"LearnerConfig.eps must be > 0, got {self.eps}")
        if self.grad_clip_norm < 0:
            raise ValueError(
                f"LearnerConfig.grad_clip_norm must be >= 0 (0 disables), got {self.grad_clip_norm}"
            )
        if self.micro_batch_size < 1:
            raise ValueError(
                f"LearnerConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}"
            )
        _check_loss("loss", self.loss, self.loss_kwargs, self.ratio_against)
        if self.replay_loss is not None:
            _check_loss(
                "replay_loss", self.replay_loss, self.replay_loss_kwargs, self.replay_ratio_against
            )
        else:
            ignored = [
                f"LearnerConfig.{f}"
                for f, default in (
                    ("replay_loss_kwargs", {}),
                    ("replay_ratio_against", "behaviour"),
                )
                if getattr(self, f) != default
            ]
            if ignored:
                raise ValueError(f"{ignored} would be ignored without LearnerConfig.replay_loss")
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(
                f"LearnerConfig.aggregation must be one of {AGGREGATION_MODES}, "
                f"got {self.aggregation!r}"
            )
        if self.aggregation == "seq-mean-token-sum-norm" and not (
            self.aggregation_max_tokens and self.aggregation_max_tokens >= 1
        ):
            raise ValueError(
                "LearnerConfig.aggregation_max_tokens must be >= 1 for "
                f"'seq-mean-token-sum-norm', got {self.aggregation_max_tokens}"
            )
        for name in ("kl_coef", "entropy_coef", "router_aux_loss_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"LearnerConfig.{name} must be finite and >= 0, got {value}")
        if not isinstance(self.router_replay, bool):
            raise ValueError(
                f"LearnerConfig.router_replay must be a bool, got {self.router_replay!r}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(
                f"LearnerConfig.sampling must be a SamplingParams, got {type(self.sampling)}"
            )
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"LearnerConfig.lora must be a LoraConfig, got {type(self.lora)}")
        if self.logprob_chunk < 1:
            raise ValueError(f"LearnerConfig.logprob_chunk must be >= 1, got {self.logprob_chunk}")
        if self.length_multiple < 1:
            raise ValueError(
                f"LearnerConfig.length_multiple must be >= 1, got {self.length_multiple}"
            )
        if self.pack_length < 0:
            raise ValueError(f"LearnerConfig.pack_length must be >= 0, got {self.pack_length}")
        if self.packing:
            check_packing(self.loss, self.aggregation, self.replay_loss)
        if self.prefix_sharing and not self.packing:
            raise ValueError(
                "LearnerConfig.prefix_sharing lays out packed rows: it needs packing=True"
            )

    @property
    def dual_cycle(self) -> bool:
        """Whether batches may carry replayed rows (a loss per cycle, per-cycle stats)."""
        return self.replay_loss is not None

    @property
    def uses_reference(self) -> bool:
        """Whether reference params are needed (KL penalty on)."""
        return self.kl_coef > 0

    def replace(self, **changes: Any) -> LearnerConfig:
        """A copy with fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
