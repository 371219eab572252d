"""Orbax checkpoints of the sharded TrainState plus a JSON metadata item.

Each checkpoint is one step directory with two items: ``state`` (the TrainState
pytree, written shard by shard) and ``meta`` (JSON: step, data cursor, host RNG
states, counters, policy version). Orbax writes into a temporary directory and
renames it only after every item is complete (atomic finalize), so a process
killed mid-save leaves a temporary directory that ``latest_step`` never sees;
restore then falls back to the previous complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE, _META = "state", "meta"


@dataclasses.dataclass(kw_only=True)
class CheckpointMeta:
    """Host-side progress saved next to the TrainState (JSON).

    Attributes:
      step: learner step of the checkpoint (== TrainState.step).
      data_cursor: index of the next dataset row to take (rows are
        deterministic in their index, so this restores the data stream).
      policy_version: version of the last published weights.
      counters: prompt-outcome and other integer counters (they must add up
        across a restart).
      python_rng: ``random.Random.getstate()`` as JSON lists, or None.
      numpy_rng: ``np.random.Generator.bit_generator.state`` dict, or None.
      extra: any other JSON-serialisable values.
    """

    step: int
    data_cursor: int = 0
    policy_version: int = 0
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    python_rng: Any = None
    numpy_rng: Any = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CheckpointMeta:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"CheckpointMeta: unknown keys {unknown} in saved metadata")
        return cls(**d)


def python_rng_state(rng: random.Random) -> list:
    """``rng.getstate()`` as nested JSON lists."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(rng: random.Random, state: list) -> None:
    """Inverse of ``python_rng_state``."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def numpy_rng_state(rng: np.random.Generator) -> dict:
    """The generator's bit-generator state (a JSON-able dict of ints)."""
    return rng.bit_generator.state


def set_numpy_rng_state(rng: np.random.Generator, state: dict) -> None:
    """Inverse of ``numpy_rng_state``."""
    rng.bit_generator.state = state


class Checkpointer:
    """Save / restore TrainState + CheckpointMeta under ``workdir``.

    Args:
      workdir: directory holding one subdirectory per saved step (created).
      max_to_keep: newest complete checkpoints kept; older ones are deleted.
      async_save: write in a background thread (the call returns once arrays
        are copied off the devices); ``wait()`` blocks until written.

    Use as a context manager, or call ``close()`` (which waits for pending saves).
    """

    def __init__(
        self, workdir: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True
    ):
        if max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1, got {max_to_keep}")
        self.workdir = os.path.abspath(os.fspath(workdir))
        self._manager = ocp.CheckpointManager(
            self.workdir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=True,
                # A save killed before finalize leaves "<step>.orbax-checkpoint-tmp";
                # remove it on start so saving that step again does not collide.
                cleanup_tmp_directories=True,
            ),
            item_names=(_STATE, _META),
        )

    def save(self, state: Any, meta: CheckpointMeta, *, force: bool = True) -> bool:
        """Start saving ``state`` (sharded pytree) and ``meta`` at ``meta.step``.

        Args:
          state: TrainState (or any pytree of jax arrays); saved shard by shard.
          meta: metadata; ``meta.step`` names the checkpoint.
          force: save even if the manager's interval policy would skip.

        Returns:
          True if a save was started.

        Raises:
          ValueError: ``meta.step`` differs from ``state.step`` (when present), or
            a checkpoint for that step already exists.
        """
        state_step = getattr(state, "step", None)
        if state_step is not None:
            # Explicit device_get: an int() would trip jax.transfer_guard("disallow").
            state_step = int(jax.device_get(state_step))
            if state_step != int(meta.step):
                raise ValueError(
                    f"Checkpointer.save: meta.step={meta.step} != state.step={state_step}"
                )
        if int(meta.step) in self._manager.all_steps():
            raise ValueError(f"Checkpointer.save: step {meta.step} already saved in {self.workdir}")
        return self._manager.save(
            int(meta.step),
            args=ocp.args.Composite(
                **{
                    _STATE: ocp.args.StandardSave(state),
                    _META: ocp.args.JsonSave(meta.to_json()),
                }
            ),
            force=force,
        )

    def wait(self) -> None:
        """Block until pending async saves are complete (and finalized)."""
        self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending (temporary dirs excluded)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, CheckpointMeta]:
        """Restore the checkpoint of ``step`` onto ``abstract_state``'s shardings.

        Args:
          step: a step in ``all_steps()``.
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set
            (``learner.state.abstract_train_state``); the mesh may differ from
            the one saved from.

        Returns:
          (state, meta): arrays placed per ``abstract_state``.

        Raises:
          ValueError: ``step`` is not a complete checkpoint (lists the ones there).
        """
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(
                f"Checkpointer.restore: no complete checkpoint for step {step} in "
                f"{self.workdir}; have {steps}"
            )
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _STATE: ocp.args.StandardRestore(abstract_state),
                    _META: ocp.args.JsonRestore(),
                }
            ),
        )
        return out[_STATE], CheckpointMeta.from_json(dict(out[_META]))

    def restore_latest(self, abstract_state: Any) -> tuple[Any, CheckpointMeta] | None:
        """Restore the newest complete checkpoint, or None if there is none."""
        step = self.latest_step()
        if step is None:
            return None
        return self.restore(step, abstract_state)

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
