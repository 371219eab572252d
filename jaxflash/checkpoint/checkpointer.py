"""Orbax checkpoints of the sharded TrainState plus a JSON metadata item.

Each checkpoint is one step directory with two items: ``state`` (the TrainState
pytree, written shard by shard) and ``meta`` (JSON: step, data cursor, host RNG
states, counters, policy version). Orbax writes into a temporary directory and
renames it only after every item is complete (atomic finalize), so a process
killed mid-save leaves a temporary directory that ``latest_step`` never sees;
restore then falls back to the previous complete checkpoint.

Storage faults (``storage.diagnose`` classifies them from the directory, not
from error text): a directory that is read-only, full or not writable fails the
save loudly with ``CheckpointWriteError`` naming the path, the step, the fault
and the previous checkpoint, which stays intact (Orbax never touches complete
checkpoints while writing a new one). A transient fault (the directory is
healthy again when probed) is retried: a failure raised while ``save`` runs
(every write, with ``async_save=False``) is retried up to ``max_retries`` times
with exponential backoff; a background write of an async save that fails is
found at the next ``save`` (which then writes the newer state: the failed step is
superseded, counted) or at ``wait``/``close`` (which raise, as nothing newer
exists to write). ``stats`` counts all of it.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import logging
import os
import random
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxflash import failpoints
from jaxflash.checkpoint.storage import CheckpointWriteError, StorageFault, diagnose

log = logging.getLogger(__name__)
_STATE, _META = "state", "meta"


class _FailpointRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic-rename commit with the ``checkpoint_commit`` failpoint before the
    step directory's rename (every byte written) and ``checkpoint_committed`` after it."""

    async def finalize(self, *args: Any, **kwargs: Any) -> None:
        # Orbax renames each item ("state", "meta") inside the step's temporary
        # directory first; the step directory ("<step>") is the commit that counts.
        step_dir = self.get_final().name.isdigit()
        if step_dir:
            failpoints.reach("checkpoint_commit")
        await super().finalize(*args, **kwargs)
        if step_dir:
            failpoints.reach("checkpoint_committed")


@dataclasses.dataclass
class CheckpointStats:
    """Counters of a Checkpointer (only go up).

    Attributes:
      saves: saves started.
      failed_writes: failed write attempts by StorageFault value.
      retries: attempts repeated after a transient fault (bounded by max_retries).
      superseded: async saves lost to a transient fault and replaced by the
        next, newer save.
    """

    saves: int = 0
    failed_writes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    retries: int = 0
    superseded: int = 0


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
      max_retries: extra attempts after a transient storage fault (0 = none).
      retry_backoff_s: wait before the first retry, doubled for each next one.

    Use as a context manager, or call ``close()`` (which waits for pending saves).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        max_retries: int = 2,
        retry_backoff_s: float = 0.5,
    ):
        if max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1, got {max_to_keep}")
        if max_retries < 0 or retry_backoff_s < 0:
            raise ValueError(
                f"Checkpointer: max_retries={max_retries} and retry_backoff_s={retry_backoff_s} "
                "must be >= 0"
            )
        self.workdir = os.path.abspath(os.fspath(workdir))
        self._max_retries, self._backoff_s = int(max_retries), float(retry_backoff_s)
        self._pending: tuple[int, int] | None = None  # (step, bytes) of an unconfirmed async save
        self.stats = CheckpointStats()
        self._manager = ocp.CheckpointManager(
            self.workdir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=True,
                # A save killed before finalize leaves "<step>.orbax-checkpoint-tmp";
                # remove it on start so saving that step again does not collide.
                cleanup_tmp_directories=True,
                # Create a step's directories inside save(): created in the
                # background (Orbax's default), a failed mkdir (read-only disk)
                # left threads waiting 20 minutes for its completion signal
                # (orbax-checkpoint 0.12.8), and the process could not exit.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                # Orbax's own commit (atomic rename on local disks), with the commit
                # failpoints around it -- only when a failpoint is armed (a test).
                temporary_path_class=_FailpointRename if failpoints.armed() else None,
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
          CheckpointWriteError: this save, or the previous async one, hit a
            permanent storage fault, or a transient one more than ``max_retries``
            times (names the directory; earlier checkpoints are intact).
        """
        state_step = getattr(state, "step", None)
        if state_step is not None:
            # Explicit device_get: an int() would trip jax.transfer_guard("disallow").
            state_step = int(jax.device_get(state_step))
            if state_step != int(meta.step):
                raise ValueError(
                    f"Checkpointer.save: meta.step={meta.step} != state.step={state_step}"
                )
        self._settle(superseded_by=int(meta.step))
        if int(meta.step) in self._manager.all_steps():
            raise ValueError(f"Checkpointer.save: step {meta.step} already saved in {self.workdir}")
        step = int(meta.step)
        need = sum(int(x.nbytes) for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta.to_json())}
        )
        for attempt in range(1, self._max_retries + 2):
            try:
                started = self._manager.save(step, args=args, force=force)
            except Exception as err:  # Orbax/TensorStore raise OSError, ValueError, ...
                fault = self._failed(step, need, err)
                if fault.permanent or attempt > self._max_retries:
                    raise self._error(step, fault, attempt, err) from err
                self.stats.retries += 1
                log.warning("checkpoint step %d: transient write fault, retry %d", step, attempt)
                time.sleep(self._backoff_s * 2 ** (attempt - 1))
                continue
            self.stats.saves += int(started)
            self._pending = (step, need) if started else None
            failpoints.reach("checkpoint_write")  # the background write is running
            return started
        raise AssertionError("unreachable")

    def _failed(self, step: int, need: int, err: BaseException) -> StorageFault:
        """Classify a failed write and remove its partial (never finalized) directory."""
        fault = diagnose(self.workdir, need_bytes=need)
        self.stats.failed_writes[fault.value] += 1
        for tmp in glob.glob(os.path.join(self.workdir, f"{step}.orbax-checkpoint-tmp*")):
            shutil.rmtree(tmp, ignore_errors=True)  # on a read-only disk: at next start
        log.warning("checkpoint step %d failed (%s): %r", step, fault.value, err)
        return fault

    def _error(
        self, step: int, fault: StorageFault, attempts: int, err: BaseException
    ) -> CheckpointWriteError:
        steps = self._complete_steps()
        return CheckpointWriteError(
            path=self.workdir,
            step=step,
            fault=fault,
            previous_step=steps[-1] if steps else None,
            attempts=attempts,
            detail=f"{type(err).__name__}: {err}"[:500],
        )

    def _complete_steps(self) -> list[int]:
        try:
            self._manager.reload()
        except Exception:  # a broken directory must not hide the write error
            pass
        return sorted(self._manager.all_steps())  # finalized steps only

    def _settle(self, *, superseded_by: int | None) -> None:
        """Wait for the previous async save; handle its failure (see the module doc)."""
        if self._pending is None:
            self._manager.wait_until_finished()
            return
        step, need = self._pending
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # the background write of ``step`` failed
            fault = self._failed(step, need, err)
            if fault.permanent or superseded_by is None:
                error = self._error(step, fault, 1, err)
                self._pending = None
                raise error from err
            self.stats.superseded += 1
            log.warning("checkpoint step %d lost (transient); step %d replaces it", step,
                        superseded_by)  # fmt: skip
        self._pending = None

    def wait(self) -> None:
        """Block until pending async saves are complete (and finalized).

        Raises:
          CheckpointWriteError: the pending save failed (any fault: nothing newer
            exists to write instead).
        """
        self._settle(superseded_by=None)

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
        """Wait for pending saves and release the manager (raises as ``wait``)."""
        try:
            self._settle(superseded_by=None)
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
