"""Weight transfer between separate JAX programs (real processes on loopback).

A learner program (one process, or two over ``jax.distributed``) offers tiny-Llama
params laid out with LEARNER_RULES and staged for the generation program's
layout; a generation program (its own process and fake CPU devices, GENERATOR_RULES
on a 2-way tensor mesh) pulls them. Checked: bit-equal leaves (sha256 on both
sides), the receiver's own shardings, the version stamp, refusal of a receiver
whose sharding the sender was not staged for, and a sender SIGKILLed between two
chunks leaving the receiver on its old version with its old bytes.
"""

import os
import subprocess
import sys

import pytest

from tests.proc_helpers import REPO, Child, child_env, free_port

SCRIPT = os.path.join(REPO, "tests", "transfer_child.py")


def _layout_file(tmp_path, mesh="tensor=2", rules="generator"):
    out = subprocess.run(
        ["timeout", "-k", "5", "120", sys.executable, SCRIPT, "layout", "--mesh", mesh,
         "--rules", rules],
        env=child_env(8), cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    path = tmp_path / f"layout_{rules}.json"
    path.write_text(out.stdout.strip().splitlines()[-1])
    return str(path)


def _sender(layout_file, *, seed, version, devices=4, extra=()):
    return Child(
        SCRIPT,
        ["sender", "--mesh", "fsdp=2,tensor=2", "--seed", str(seed), "--version", str(version),
         "--stage_for", layout_file, *extra],
        devices=devices,
    )  # fmt: skip


def _receiver(senders, method, *args):
    return Child(
        SCRIPT,
        ["receiver", "--mesh", "tensor=2", "--senders", ",".join(senders), "--method", method,
         *args],
        devices=2,
    )  # fmt: skip


def test_pull_across_programs_bit_equal_and_mismatch_refused(tmp_path):
    layout = _layout_file(tmp_path)
    sender = _sender(layout, seed=3, version=7)
    try:
        ready = sender.next_event("ready")
        r = _receiver([ready["address"]], "transfer,stream", "--fresh_each")
        try:
            for method in ("transfer", "stream"):
                result = r.next_event("result")
                state = r.next_event("state")
                assert result["method"] == method and result["error_kind"] is None, result
                assert result["version"] == 7 and result["shardings_ok"]
                assert state["version"] == 7 and state["digest"] == ready["digest"]
            assert r.wait() == 0
        finally:
            r.stop()
        # A generation program laid out with the learner's rules: not what was staged.
        bad = Child(
            SCRIPT,
            ["receiver", "--mesh", "fsdp=2", "--rules", "learner", "--senders",
             ready["address"], "--method", "transfer,stream", "--fresh_each"],
            devices=2,
        )  # fmt: skip
        try:
            for _ in ("transfer", "stream"):
                result = bad.next_event("result")
                assert result["error_kind"] == "layout_mismatch", result
                assert "sharding mismatch" in result["error"]
                err = result["error"]
                assert "leaf ['embed_vd']" in err
                assert (
                    "receiver's layout float32[512, 64] on mesh "
                    "(data=1, fsdp=2, expert=1, tensor=1)" in err
                )
                assert (
                    "sender's layout float32[512, 64] on mesh (transfer_replica=2, data=1, " in err
                )
                assert bad.next_event("state")["version"] is None
        finally:
            bad.stop()
    finally:
        sender.stop()


@pytest.mark.parametrize("method", ["transfer", "stream"])
def test_sender_killed_mid_transfer_leaves_old_version(tmp_path, method):
    layout = _layout_file(tmp_path)
    sender = _sender(layout, seed=5, version=2)
    go = tmp_path / "go"
    try:
        address = sender.next_event("ready")["address"]
        r = _receiver([address], method, "--initial_seed", "4", "--initial_version", "1",
                      "--chunk_bytes", "150000", "--wait_file", str(go))  # fmt: skip
        try:
            chunk = r.next_event("chunk")
            assert chunk["done"] < chunk["total"]  # really part-way
            sender.sigkill()  # SIGKILL: no chance to finish or clean up
            go.write_text("")
            result = r.next_event("result")
            assert result["error_kind"] == "connection", result
            state = r.next_event("state")
            assert state["version"] == 1
            # Bytes of the initial weights, not a mix with version 2.
            expected = Child(SCRIPT, ["receiver", "--mesh", "tensor=2", "--senders", "x:1",
                                      "--initial_seed", "4", "--initial_version", "1",
                                      "--method", "stream"], devices=2)  # fmt: skip
            try:
                reference = expected.next_event("state")
            finally:
                expected.stop()
            assert reference["version"] == 1 and state["digest"] == reference["digest"]
        finally:
            r.stop()
    finally:
        sender.stop()


@pytest.mark.slow
def test_two_process_learner_sends_to_one_generation_program(tmp_path):
    layout = _layout_file(tmp_path)
    coordinator = f"127.0.0.1:{free_port()}"
    senders = [
        _sender(layout, seed=9, version=4, devices=2,
                extra=("--coordinator", coordinator, "--num_processes", "2",
                       "--process_id", str(i)))
        for i in range(2)
    ]  # fmt: skip
    try:
        ready = [s.next_event("ready") for s in senders]
        assert ready[0]["digest"] == ready[1]["digest"]  # the global arrays, gathered
        r = _receiver([e["address"] for e in ready], "transfer,stream", "--fresh_each")
        try:
            for method in ("transfer", "stream"):
                result = r.next_event("result")
                assert result["error_kind"] is None and result["version"] == 4, (method, result)
                assert r.next_event("state")["digest"] == ready[0]["digest"]
        finally:
            r.stop()
    finally:
        for s in senders:
            s.stop()
