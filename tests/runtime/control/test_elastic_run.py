"""The elastic pool in the one RLVR loop: a fixed schedule grows the learner, then shrinks it.

configs/elastic_smoke.py: a learner of fsdp 6 on devices 0-5 and two one-device
generation slices (6, 7), alpha = 1, ``controller.device_schedule="0:6,2:7,4:6"``:
after step 2 the learner takes slice [6] (its server stops, its requests are
re-queued on [7]) and trains steps 3-4 on 7 devices; after step 4 it gives [6]
back (a new server there gets the current weights first). Checked:

* the run completes, the metrics rows show the split and the moves;
* params and optimizer state are bit-equal just before and just after each reshard,
  and land on the new learner devices;
* the train step compiles once per layout (moving back to 6 devices reuses the
  first one) and the generation engine for device 6 is reused;
* every re-queued request is counted (the pool's count = the scheduler's) and the
  prompt books add up; nothing is trained twice;
* resume: a checkpoint saved on the grown layout restores on a fresh start, which
  moves back to the grown split before its first step (``runtime.control.elastic``).
"""

import collections
import json

import jax
import numpy as np
import pytest

from configs import elastic_smoke
from jaxflash.runtime import loop as rlvr
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.fleet.gen_server import GenerationServer
from jaxflash.runtime.fleet.learner_program import LearnerProgram
from tests.runtime.test_rlvr import _undocumented

ENDS = ("trained", "filtered", "stale", "failed")


def _rows(path):
    return [json.loads(x) for x in open(path)]


def _config(total_steps):
    c = elastic_smoke.get_config()  # learner fsdp 6 + slices [6], [7]; "0:6,2:7,4:6"
    c.total_steps = total_steps
    c.checkpoint.every = 1
    return c


class _Holding:
    """Server gen0, except that from weights version 1 on it never finishes a request
    (a slow slice): at the step-2 boundary it surely holds requests, which the move
    must re-queue on gen1. Every other call goes to the real server."""

    def __init__(self, server):
        self._server, self._holding, self.held = server, False, set()
        self.partial_rollout = server.partial_rollout

    def __getattr__(self, name):
        return getattr(self._server, name)

    def submit(self, request):
        if not self._holding:
            return self._server.submit(request)
        self.held.add((int(request.prompt_id), int(request.sample_index)))

    def abort_prompt(self, prompt_id):
        keys = {k for k in self.held if k[0] == int(prompt_id)}
        self.held -= keys
        return len(keys) + self._server.abort_prompt(prompt_id)

    def update_weights(self, params, version):
        self._server.update_weights(params, version)
        self._holding = self._holding or version >= 1


def _server_factory(name, *args, **kw):
    server = GenerationServer(name, *args, **kw)
    return _Holding(server) if name == "gen0" else server


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


class _Spy:
    """Wraps LearnerProgram.move_to: the state gathered before and after each move."""

    def __init__(self, monkeypatch):
        self.moves, self.learners = [], []
        original = LearnerProgram.move_to

        def move_to(program, mesh):
            before = _host(program.state)
            report = original(program, mesh)
            after = _host(program.state)
            devices = {d.id for x in jax.tree.leaves(program.state) for d in x.sharding.device_set}
            self.moves.append((before, after, devices, {d.id for d in mesh.devices.flat}))
            if program not in self.learners:
                self.learners.append(program)
            return report

        monkeypatch.setattr(LearnerProgram, "move_to", move_to)
        self.saved = []  # (step, state gathered, its learner devices) per checkpoint
        save = LearnerProgram.save

        def saving(program, meta):
            devices = {d.id for x in jax.tree.leaves(program.state) for d in x.sharding.device_set}
            self.saved.append((meta.step, _host(program.state), devices))
            return save(program, meta)

        monkeypatch.setattr(LearnerProgram, "save", saving)


def _check_bit_equal(moves):
    for before, after, devices, mesh_ids in moves:
        assert len(before) == len(after) > 0
        for b, a in zip(before, after, strict=True):
            assert b.dtype == a.dtype and np.array_equal(b, a)  # bit for bit (no NaN here)
        assert devices == mesh_ids  # every leaf lives on the new learner mesh


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_live_grow_then_shrink_keeps_state_counts_requeues_and_compiles_once(tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    exp = ExperimentConfig.from_config_dict(_config(6))
    rlvr.run(exp, workdir=str(tmp_path), server_factory=_server_factory)
    m = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5, 6]
    # The split after each boundary (in force for the next step) and the moves.
    assert [r["learner_devices"] for r in m] == [6, 7, 7, 6, 6, 6]
    assert [r["generation_slices"] for r in m] == [2, 1, 1, 2, 2, 2]
    assert [r["elastic_moves"] for r in m] == [0, 1, 1, 2, 2, 2]
    assert [r["elastic_to_learner"] for r in m] == [0, 1, 0, 0, 0, 0]
    assert [r["elastic_to_generation"] for r in m] == [0, 0, 0, 1, 0, 0]
    assert [r["ctl_learner_devices"] for r in m] == [6, 7, 7, 6, 6, 6]  # applied == in force
    assert m[1]["elastic_reshard_bytes"] > 0 and m[3]["elastic_reshard_bytes"] > 0
    # Generation servers: gen0 retired after step 2, gen2 (device 6 again) from step 5 on.
    assert "gen0_occupancy" in m[0] and "gen0_occupancy" not in m[3]
    assert "gen2_occupancy" in m[4] and "gen1_occupancy" in m[4]
    # Bit-equal state across both reshards, on the new devices.
    assert len(spy.moves) == 2
    _check_bit_equal(spy.moves)
    assert spy.moves[0][3] == set(range(7)) and spy.moves[1][3] == set(range(6))
    # Compiled once per layout: two steps built, each traced once; moving back to 6
    # devices reused the first. The engine of device 6 was reused too.
    (learner,) = spy.learners
    assert len(learner.train_steps) == 2
    assert [s.trace_count for s in learner.train_steps] == [1, 1]
    assert m[-1]["elastic_train_step_builds"] == 2 and m[-1]["elastic_engine_builds"] == 2
    # Re-queued requests: counted by the pool and by the scheduler alike; books add up.
    last = m[-1]
    assert last["elastic_requeued"] == last["samples_requeued"] > 0
    assert m[1]["elastic_requeued"] == last["elastic_requeued"]  # only growing re-queues
    for r in m:
        assert r["prompts_taken"] == sum(r[f"prompts_{o}"] for o in ENDS) + r["prompts_in_flight"]
        assert 0 <= r["staleness_max"] <= 1
    assert last["prompts_trained"] == 6 * 4
    trained = [r for r in _rows(tmp_path / "rollouts.jsonl") if r["outcome"] == "trained"]
    keys = collections.Counter((r["prompt_id"], r["sample_index"]) for r in trained)
    assert len(keys) == 6 * 4 * 2 and max(keys.values()) == 1  # nothing trained twice
    assert not _undocumented(m)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resume_from_a_checkpoint_on_the_grown_layout(tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    workdir = str(tmp_path / "run")
    rlvr.run(ExperimentConfig.from_config_dict(_config(3)), workdir=workdir)  # saved on 7
    saved = _rows(f"{workdir}/metrics.jsonl")
    assert saved[-1]["learner_devices"] == 7
    step, saved_state, saved_devices = spy.saved[-1]
    assert step == 3 and saved_devices == set(range(7))  # saved on the grown layout
    assert len(spy.moves) == 1
    # A fresh start in the same workdir: restored onto mesh.learner (6), then moved back
    # to the checkpoint's split (7) before the first step: not counted as a new move.
    rlvr.run(ExperimentConfig.from_config_dict(_config(5)), workdir=workdir)
    m = _rows(f"{workdir}/metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5]
    assert [r["learner_devices"] for r in m[3:]] == [6, 6]
    assert [r["elastic_moves"] for r in m] == [0, 1, 1, 2, 2]
    assert len(spy.moves) == 3  # resume move (6 -> 7), then the schedule's (7 -> 6)
    _check_bit_equal(spy.moves[1:])
    assert spy.moves[1][3] == set(range(7)) and spy.moves[2][3] == set(range(6))
    # The state restored on mesh.learner (6 devices) is the one saved on 7, bit for bit.
    restored = spy.moves[1][0]
    assert len(restored) == len(saved_state)
    assert all(np.array_equal(a, b) for a, b in zip(restored, saved_state, strict=True))
    last = m[-1]
    assert last["prompts_trained"] == 5 * 4
    assert (
        last["prompts_taken"] == sum(last[f"prompts_{o}"] for o in ENDS) + last["prompts_in_flight"]
    )
