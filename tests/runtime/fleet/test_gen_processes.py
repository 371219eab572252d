"""Generation servers as separate processes (gRPC), driven by the one RL loop.

The controller + learner run in this test process (8 fake CPU devices, learner on
6 of them); each generation slice is its own JAX program, a child process
(``runtime.fleet.gen_program``) with one fake device, reached over loopback gRPC and
pulling every policy version from the learner's ``WeightSender``.

Checked:
* with α = 0 the process run reproduces the thread run: same prompts, sampled
  tokens, rewards and learner metrics; every program installs every version bit
  for bit equal to the learner's params (SHA-256 on both sides); both evaluate
  (before training and at the last step), the process run through its programs;
* a generation process SIGKILLed while it holds samples: detected, its samples
  re-routed to the other server, the process restarted and resynced to the
  current version; the run completes and every prompt is accounted for.
"""

import json
import os
import signal
import threading
import time

import grpc
import pytest

from configs import smoke_async
from jaxflash.runtime import loop as rlvr
from jaxflash.runtime.config.experiment import ExperimentConfig
from jaxflash.runtime.console import Console
from jaxflash.runtime.fleet import rpc_wire
from tests.runtime.test_rlvr import _undocumented


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _config(
    *,
    processes: bool,
    steps: int,
    alpha: int,
    digests: bool = False,
    delta: bool = False,
    max_new_tokens: int = 8,
    eval_size: int = 0,
):
    c = smoke_async.get_config()  # learner fsdp 3 x tensor 2, two 1-device slices
    c.rollout.max_new_tokens = max_new_tokens
    c.total_steps = steps
    c.data.eval_size = eval_size  # > 0: evaluated on the programs too (fleet.eval_generation)
    c.rollout.async_ratio = alpha
    c.checkpoint.every = 1
    c.mesh.generation_processes = processes
    c.mesh.generation_digests = digests and processes
    c.mesh.delta_publish = delta
    return ExperimentConfig.from_config_dict(c)


def _accounted(m):
    """Every prompt taken ends trained, filtered, stale, failed, or is still in flight."""
    ends = ("prompts_trained", "prompts_filtered", "prompts_stale", "prompts_failed")
    return m["prompts_taken"] == sum(m[k] for k in ends) + m["prompts_in_flight"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_generation_processes_reproduce_the_thread_run_bit_for_bit(tmp_path, delta):
    threads, procs = str(tmp_path / "threads"), str(tmp_path / "procs")
    rlvr.run(_config(processes=False, steps=2, alpha=0, eval_size=2), workdir=threads)
    # delta: versions 1 and 2 are deltas over the engine-side tree (digests hash it)
    exp = _config(processes=True, steps=2, alpha=0, digests=True, eval_size=2, delta=delta)
    last = rlvr.run(exp, workdir=procs)
    assert last["policy_version"] == 2 and _accounted(last)

    def by_key(workdir):
        rows = _rows(os.path.join(workdir, "rollouts.jsonl"))
        return {(r["learner_step"], r["prompt_id"], r["sample_index"]): r for r in rows}

    t_rows, p_rows = by_key(threads), by_key(procs)
    assert sorted(t_rows) == sorted(p_rows) and len(t_rows) == 16
    for key, row in t_rows.items():
        for field in ("response_tokens", "reward", "start_version", "finish_reason"):
            assert p_rows[key][field] == row[field], (key, field)
    p_metrics = _rows(os.path.join(procs, "metrics.jsonl"))
    assert [r["step"] for r in p_metrics if "eval_accuracy" in r] == [0, 2]
    for t, p in zip(_rows(os.path.join(threads, "metrics.jsonl")), p_metrics, strict=True):
        if "eval_accuracy" in p:  # evaluated (at steps 0 and 2) on the programs too
            assert p["eval_prompts"] == t["eval_prompts"] == 2 and p["eval_failed"] == 0
        if t["step"] == 0:
            continue  # the evaluation before training: no update
        for key in ("tokens", "loss", "pg_loss", "grad_norm", "prompts_trained"):
            assert p[key] == t[key], (t["step"], key)  # behaviour logprobs crossed bit for bit

    # Weights: every program installed versions 0, 1, 2, each equal to the learner's.
    gen_dir = os.path.join(procs, "generation")
    learner = {r["version"]: r["digest"] for r in _rows(os.path.join(gen_dir, "learner.jsonl"))}
    assert sorted(learner) == [0, 1, 2]
    for name in ("gen0", "gen1"):
        installed = {
            e["version"]: e["digest"]
            for e in _rows(os.path.join(gen_dir, f"{name}.jsonl"))
            if e["event"] == "installed"
        }
        assert installed == learner, name
    if delta:  # the programs pulled deltas after the first full tree, and said so
        for name in ("gen0", "gen1"):
            moved = [
                e["moved"]
                for e in _rows(os.path.join(gen_dir, f"{name}.jsonl"))
                if e["event"] == "installed"
            ]
            assert len(moved) == 3 and 0 < max(moved[1:]) < moved[0], (name, moved)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_a_generation_process_reroutes_restarts_and_completes(tmp_path):
    workdir = str(tmp_path / "run")
    log0 = os.path.join(workdir, "generation", "gen0.jsonl")
    killed: dict = {}

    def kill_gen0_while_it_holds_samples():
        # Ask gen0 itself (its Stats call) until it has samples queued or running,
        # then SIGKILL it: those samples are in flight and must be re-routed.
        end = time.monotonic() + 600
        channel = None
        while time.monotonic() < end and not killed:
            events = _rows(log0) if os.path.exists(log0) else []
            ups = [e for e in events if e["event"] == "up"]
            if not ups:
                time.sleep(0.05)
                continue
            if channel is None:
                with open(os.path.join(workdir, "generation", "gen0.log")) as f:
                    line = next(x for x in f if '"listening"' in x)
                channel = grpc.insecure_channel(json.loads(line)["address"])
                stats = channel.unary_unary(f"/{rpc_wire.SERVICE}/Stats")
            status, fields = rpc_wire.reply_status(stats(rpc_wire.encode({}), timeout=10))
            if status is rpc_wire.Status.OK and fields["stats"]["queued_or_running"] > 0:
                os.kill(int(ups[0]["pid"]), signal.SIGKILL)
                killed.update(pid=int(ups[0]["pid"]), t=time.time())
            time.sleep(0.005)
        if channel is not None:
            channel.close()

    def restarted_gen0_delivered() -> bool:
        """gen0's restarted program (its own Stats call) has delivered a sample."""
        with open(os.path.join(workdir, "generation", "gen0.log")) as f:
            lines = [x for x in f if '"listening"' in x]
        if len(lines) < 2:
            return False
        with grpc.insecure_channel(json.loads(lines[-1])["address"]) as channel:
            stats = channel.unary_unary(f"/{rpc_wire.SERVICE}/Stats")
            try:
                status, fields = rpc_wire.reply_status(stats(rpc_wire.encode({}), timeout=10))
            except grpc.RpcError:
                return False
        return status is rpc_wire.Status.OK and fields["stats"]["delivered"] > 0

    class SlowLearner(Console):
        """Step 3 starts only once the restarted gen0 has served a sample (a restart
        plus its first compile take longer than a tiny step here)."""

        def background(self, label):
            if label == "step 3/4":
                end = time.monotonic() + 600
                while time.monotonic() < end and not restarted_gen0_delivered():
                    time.sleep(0.2)
            super().background(label)

    killer = threading.Thread(target=kill_gen0_while_it_holds_samples, daemon=True)
    killer.start()
    # Longer samples: each holds a slot for 32 decode steps, a window the killer sees.
    exp = _config(processes=True, steps=4, alpha=2, digests=True, max_new_tokens=32)
    last = rlvr.run(exp, workdir=workdir, console=SlowLearner(None))
    killer.join(1)
    assert killed, "gen0 never held a sample"

    assert last["policy_version"] == 4 and _accounted(last)
    assert last["prompts_trained"] == 4 * exp.rollout.prompts_per_step
    assert last.get("server_failures", 0) == 1
    assert last.get("server_recoveries", 0) == 1
    assert last.get("samples_rerouted", 0) >= 1, "gen0 held no samples when it was killed"
    events = _rows(log0)
    died = [e for e in events if e["event"] == "died"]
    ups = [e for e in events if e["event"] == "up"]
    assert len(died) == 1 and len(ups) == 2
    assert died[0]["t"] - killed["t"] < 30.0  # the broken event stream is seen at once
    assert ups[1]["pid"] != killed["pid"]
    # Resynced to the version current at its restart, then followed every later one,
    # bit for bit equal to the learner's.
    learner = {
        r["version"]: r["digest"]
        for r in _rows(os.path.join(workdir, "generation", "learner.jsonl"))
    }
    installed = [e for e in events if e["event"] == "installed"]
    before = [e["version"] for e in installed if e["t"] < died[0]["t"]]
    after = [e for e in installed if e["t"] >= died[0]["t"]]
    assert after and after[-1]["version"] == 4
    assert after[0]["version"] >= max(before)  # resynced, never back to an older version
    assert all(e["digest"] == learner[e["version"]] for e in installed)
    assert killed["t"] < ups[1]["t"]
    # The restarted gen0 delivered samples to the scheduler; no per-step difference of
    # its cumulative stats went negative across the restart.
    stopped = [e for e in events if e["event"] == "stopped"]
    assert stopped[-1]["delivered"] > died[0]["delivered"]
    rows = _rows(os.path.join(workdir, "metrics.jsonl"))
    assert all(r["gen_tokens"] >= 0 and r.get("gen0_occupancy", 0) >= 0 for r in rows)
    assert not _undocumented(rows)  # server_recoveries & co. are in the README's table


def _rows_so_far(path):
    """The complete lines of a JSON-lines file another process is writing."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f.read().split("\n")[:-1] if x]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two programs, one restart and a learner on 2 busy cores
def test_lora_programs_pull_only_adapters_match_the_learner_and_resync_after_a_restart(tmp_path):
    """LoRA (int8 base) with generation programs: each program builds the base itself
    (digest checked against the learner's), every pull moves the adapters only, the
    behaviour logprobs equal the learner's under them, and a program SIGKILLed after
    version 1 restarts, builds its base again and resyncs to the current adapters."""
    from jaxflash.models.adapters import lora
    from jaxflash.models.decoder.transformer import abstract_params
    from jaxflash.runtime.model_setup import load_model, load_tokenizer

    workdir = str(tmp_path / "run")
    log0 = os.path.join(workdir, "generation", "gen0.jsonl")
    killed: dict = {}

    def kill_gen0_after_version_1():
        end = time.monotonic() + 600
        while time.monotonic() < end:
            events = _rows_so_far(log0)
            if any(e["event"] == "installed" and e["version"] >= 1 for e in events):
                pid = next(e["pid"] for e in events if e["event"] == "up")
                os.kill(int(pid), signal.SIGKILL)
                killed.update(pid=int(pid), t=time.time())
                return
            time.sleep(0.02)

    class WaitForTheRestart(Console):
        def background(self, label):
            if label == "step 3/3":  # the restarted gen0 follows the last publish too
                end = time.monotonic() + 600
                while time.monotonic() < end and not (
                    sum(e["event"] == "up" for e in _rows_so_far(log0)) >= 2
                ):
                    time.sleep(0.2)
            super().background(label)

    c = smoke_async.get_config()
    c.rollout.max_new_tokens = 8
    c.total_steps = 3
    c.data.eval_size = 0
    c.rollout.async_ratio = 0
    c.checkpoint.every = 3
    c.mesh.generation_processes = True
    c.mesh.generation_digests = True
    c.learner.lora = {"rank": 4, "base_dtype": "int8"}
    exp = ExperimentConfig.from_config_dict(c)
    killer = threading.Thread(target=kill_gen0_after_version_1, daemon=True)
    killer.start()
    last = rlvr.run(exp, workdir=workdir, console=WaitForTheRestart(None))
    killer.join(1)
    assert killed and last["policy_version"] == 3 and _accounted(last)

    model_config, _ = load_model(exp.model, exp.rollout, load_tokenizer(exp.model))
    adapter_bytes = lora.tree_bytes(lora.adapter_layout(model_config, exp.learner.lora)[0])
    full_bytes = lora.tree_bytes(abstract_params(model_config))
    assert adapter_bytes < 0.2 * full_bytes
    rows = _rows(os.path.join(workdir, "metrics.jsonl"))
    assert [r["publish_bytes"] for r in rows] == [2 * adapter_bytes] * 3  # per program
    # Behaviour logprobs (engine, int8 base + adapters) = the learner's recomputation.
    assert max(r["logprob_gap_on_policy_max"] for r in rows) < 1e-5

    gen_dir = os.path.join(workdir, "generation")
    learner = {r["version"]: r["digest"] for r in _rows(os.path.join(gen_dir, "learner.jsonl"))}
    assert sorted(learner) == [0, 1, 2, 3] and len(set(learner.values())) == 4
    gen1 = [e for e in _rows(os.path.join(gen_dir, "gen1.jsonl")) if e["event"] == "installed"]
    assert [e["version"] for e in gen1] == [0, 1, 2, 3]
    # The receiver's byte count grows by the adapters alone at every pull (no base).
    assert [e["bytes"] for e in gen1] == [adapter_bytes * (k + 1) for k in range(4)]
    assert all(e["digest"] == learner[e["version"]] for e in gen1)
    events = _rows(log0)
    died = [e for e in events if e["event"] == "died"]
    ups = [e for e in events if e["event"] == "up"]
    assert len(died) == 1 and len(ups) == 2 and ups[1]["pid"] != killed["pid"]
    installed = [e for e in events if e["event"] == "installed"]
    before = [e["version"] for e in installed if e["t"] < died[0]["t"]]
    after = [e for e in installed if e["t"] >= died[0]["t"]]
    assert after[0]["version"] >= max(before) >= 1 and after[-1]["version"] == 3
    assert after[0]["bytes"] == adapter_bytes  # a fresh receiver: its first pull, adapters only
    assert all(e["digest"] == learner[e["version"]] for e in installed)


def test_a_program_whose_lora_base_differs_is_refused_naming_both_digests():
    from jaxflash.runtime.fleet.gen_endpoint import ProgramClient, ProgramUnavailableError

    client = ProgramClient.__new__(ProgramClient)  # the check alone, no program
    client.endpoint, client.address = type("E", (), {"name": "gen0"})(), "h:1"
    client.base_digest, client.expected_base_digest = "ab12", "cd34"
    with pytest.raises(ProgramUnavailableError, match="digest ab12.*has digest cd34"):
        client.check_base()
    client.base_digest = "cd34"
    client.check_base()
