"""What a user sees: progress during long phases, labelled step lines, one-line errors."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import types

import pytest

from configs import rlvr_smollm2_arith, smoke
from jaxflash.runtime.config.experiment import ConfigError, ExperimentConfig
from jaxflash.runtime.console import Console, EvalStatus, GenerationStatus, duration, step_line
from tests.paths import REPO


def _wait_for(predicate, timeout_s=10.0):
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.01)


def test_a_long_phase_prints_its_progress_after_each_silence():
    out = io.StringIO()
    console = Console(out, every_s=0.05)
    done = {"n": 0}
    with console.phase("step 1/3: generating", lambda: f"{done['n']}/8 samples"):
        for n in range(1, 4):
            done["n"] = n
            _wait_for(lambda n=n: f"{n}/8 samples" in out.getvalue())
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  step 1/3: generating: 1/8 samples (")
    assert lines[0].endswith(" s)")  # elapsed, with its unit
    time.sleep(0.2)  # outside a phase, with nothing in the background: silence
    n = len(out.getvalue().splitlines())
    console.line("step 1/3 | elapsed 1 s")
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == n + 1
    # Between phases the background names the work; an inner phase takes over while it lasts.
    console.background("step 2/3")
    _wait_for(lambda: out.getvalue().splitlines()[-1].startswith("  step 2/3 ("))
    with console.phase("step 2/3: training"):
        _wait_for(lambda: out.getvalue().splitlines()[-1].startswith("  step 2/3: training ("))
    _wait_for(lambda: out.getvalue().splitlines()[-1].startswith("  step 2/3 ("))
    console.background(None)
    time.sleep(0.2)
    n = len(out.getvalue().splitlines())
    time.sleep(0.2)
    assert len(out.getvalue().splitlines()) == n
    console.close()


def test_announced_phase_and_a_status_that_fails():
    out = io.StringIO()
    console = Console(out, every_s=0.05)

    def broken():
        raise RuntimeError("counter gone")

    with console.phase("loading", broken, announce="loading the model (SmolLM2) ..."):
        _wait_for(lambda: "loading: ?" in out.getvalue())  # never raises into the run
    assert out.getvalue().splitlines()[0] == "loading the model (SmolLM2) ..."
    console.close()
    console.close()  # idempotent
    silent = Console(None)
    with silent.phase("anything", broken):
        pass
    assert silent._thread is None  # nothing to print: no thread


def test_status_lines_count_from_their_start_and_say_true_things():
    class Sched:
        generated, scored, tokens, alpha = 6, 5, 100, 0

        def stats(self):
            return {
                "samples_generated": self.generated,
                "samples_scored": self.scored,
                "sched_async_ratio": self.alpha,
            }

        def server_stats(self):
            return [{"generated_tokens": self.tokens}, {}]  # a dead server reports {}

    now = [10.0]
    sched = Sched()
    status = GenerationStatus(sched, lambda: now[0], samples=32)
    sched.generated, sched.scored, sched.tokens, now[0] = 16, 12, 500, 20.0
    assert status() == (
        "10 samples generated, 7 scored (this step needs 32 samples), 400 tokens at 40.0 tokens/s"
    )
    sched.tokens = 900.0  # a generation process's stats come as JSON floats
    assert status().endswith(", 800 tokens at 80.0 tokens/s")
    # alpha > 0: the servers also generate samples for later steps ("12/8 generated"
    # was printed before): the count says it includes them and is no fraction.
    sched.alpha = 1
    ahead = GenerationStatus(sched, lambda: now[0], samples=8)
    sched.generated, sched.scored = 28, 24
    assert ahead().startswith("12 samples generated incl. ahead, 12 scored (this step needs 8")
    # Agentic: every turn is a generated sample; the need counts finished episodes.
    sched.stats = lambda: {"samples_generated": 96, "episodes_finished": 3}
    turns = GenerationStatus(sched, lambda: now[0], samples=16, episodes=True)
    sched.stats = lambda: {"samples_generated": 183, "episodes_finished": 8}
    now[0] = 30.0
    assert turns() == (
        "87 turns generated, 5 episodes finished (this step needs 16 episodes), 0 tokens at "
        "0.0 tokens/s"
    )
    now[0] = 20.0
    ev = EvalStatus(lambda: now[0])
    assert ev() == "starting (no samples counted yet)"  # was "0/0 samples"
    ev.update(3, 200, 90)
    now[0] = 23.0
    assert ev() == "3/200 samples finished, 90 tokens at 30.0 tokens/s"
    episodes = EvalStatus(lambda: now[0], unit="episodes")
    episodes.update(0, 64, 0)
    assert episodes().startswith("0/64 episodes finished, 0 tokens")
    assert [duration(s) for s in (4.4, 65, 3725)] == ["4 s", "1 min 05 s", "1 h 02 min"]


def test_agentic_evaluation_reports_its_episode_count_before_the_first_batch_ends():
    """calibrate_success (agentic eval) says the total at the start: the console showed
    "0/0 samples" until the first lockstep batch of episodes had finished."""
    from jaxflash.envs.calibration import calibrate_success  # noqa: PLC0415
    from jaxflash.envs.chat import TurnRenderer  # noqa: PLC0415
    from jaxflash.envs.registry import make_env  # noqa: PLC0415
    from jaxflash.types import SamplingParams  # noqa: PLC0415
    from tests.envs_fixtures import chatml_tokenizer, scripted_policy  # noqa: PLC0415

    calls = []
    tok = chatml_tokenizer()
    calibrate_success(
        lambda: make_env("frozenlake", size=3, max_turns=2, max_tokens_per_turn=8),
        TurnRenderer(tok),
        scripted_policy(tok, lambda request: "<answer>Left</answer>"),
        seeds=[0, 1],
        n=2,
        sampling=SamplingParams(max_new_tokens=8),
        max_context_tokens=512,
        episodes_per_batch=3,
        progress=lambda done, total, tokens: calls.append((done, total)),
    )
    assert calls == [(0, 4), (3, 4), (4, 4)]


def test_step_line_labels_every_column():
    line = step_line(
        3,
        20,
        "5 min 12 s",
        {
            "step_time_s": 190.24,
            "reward_mean": 0.25,
            "accuracy": 0.125,
            "response_len_mean": 18.25,
            "staleness_max": 2,
            "gen_tokens_per_s": 45.12,
            "train_tokens_per_s": 812.0,
            "eval_accuracy": 0.115,
            "eval_accuracy_stderr": 0.024,
            "eval_prompts": 100,
        },
    )
    assert line == (
        "step 3/20 | elapsed 5 min 12 s | step_time 190.2 s | reward_mean 0.250 | "
        "accuracy 0.125 | response_len_mean 18.2 tokens | staleness_max 2 | "
        "generation 45.1 tokens/s | training 812.0 tokens/s | "
        "eval_accuracy 0.115 ± 0.024 (100 prompts)"
    )
    async_replay = step_line(
        4, 8, "1 min",
        {"logprob_gap_on_policy_max": 0.0, "on_policy_tokens": 0, "cycle_replay_samples": 12},
    )  # fmt: skip
    assert async_replay == (
        "step 4/8 | elapsed 1 min | logprob_gap_on_policy_max n/a (no on-policy tokens) | "
        "replayed 12 samples"
    )
    skipped = step_line(2, 2, "9 s", {"skipped": "all_truncated", "reward_mean": 0.0})
    assert skipped == (
        "step 2/2 | elapsed 9 s | skipped: all_truncated (nothing to train) | reward_mean 0.000"
    )


def _launch(tmp_path, *overrides):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "launch", "tpu_pod.py"),
            "--config",
            os.path.join(REPO, "configs", "smoke.py"),
            "--workdir",
            str(tmp_path / "w"),
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "--config.rollout.max_new_token=4",
            "config error: unknown config key 'rollout.max_new_token' "
            "(did you mean 'rollout.max_new_tokens'?)",
        ),
        ("--config.rolout.top_k=4", "config error: unknown config key 'rolout' (did you mean"),
        ("--config.rollout.max_new_tokens=abc", "config error: bad command line: flag"),
        (  # a key a mapping-valued field lacks: the message says how to write it
            "--config.replay.correction_kwargs.tis_cap=2.0",
            "config error: unknown config key 'replay.correction_kwargs.tis_cap' (known: []); "
            "replay.correction_kwargs is a mapping: a key it does not have is set by giving "
            "the whole mapping as JSON, e.g. "
            """--config.replay.correction_kwargs='{"tis_cap": 2.0}'""",
        ),
        (  # JSON (null) in a mapping-valued field reaches the config-time check
            """--config.learner.loss_kwargs={"clip_eps_low": null}""",
            "config error: learner.loss_kwargs.clip_eps_low must be a finite number, got None",
        ),
        (
            "--config.data.task=countdwn",
            "config error: data.task: unknown task 'countdwn'; known: "
            "['arithmetic', 'code_file', 'countdown'",
        ),
    ],
)
def test_launcher_says_a_bad_override_in_one_line(tmp_path, override, message):
    proc = _launch(tmp_path, override)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(message), proc.stderr
    assert proc.stderr.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "w").exists()
    assert "JetStream" not in proc.stdout  # the RL runtime never imports it (issue 31)


def test_launcher_refuses_a_missing_config_file_and_a_file_as_workdir_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    launch = [sys.executable, os.path.join(REPO, "launch", "tpu_pod.py")]
    run = dict(cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    proc = subprocess.run([*launch, "--config", "configs/nosuch.py", "--workdir", "w"], **run)
    assert proc.returncode == 2
    assert proc.stderr == "config error: --config configs/nosuch.py: no such file\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    config = os.path.join(REPO, "configs", "smoke.py")
    proc = subprocess.run([*launch, "--config", config, "--workdir", str(afile)], **run)
    assert proc.returncode == 2
    assert proc.stderr == f"config error: --workdir {afile} is a file, not a directory\n"


def _exp(**overrides):
    c = rlvr_smollm2_arith.get_config()
    for key, value in overrides.items():
        section, field = key.split("__")
        c[section][field] = value
    return ExperimentConfig.from_config_dict(c)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"learner__advantage": "grpoo"}, "learner.advantage must be one of"),
        ({"learner__loss": "pp0"}, "loss must be one of"),
        ({"reward__fn": "mathh"}, "reward.fn must be '' (the task's own reward)"),
        ({"data__task": "gsm8k"}, "data.task: unknown task 'gsm8k'"),
        ({"rollout__partial_rollout": "resume"}, "rollout.partial_rollout must be"),
        ({"rollout__truncation": "cut"}, "rollout.truncation must be"),
        ({"model__source": "random", "model__preset": "huge"}, "model.preset: unknown"),
        ({"data__task": "countdown", "reward__fn": "math"}, "reward.fn='math' cannot verify"),
        ({"data__path": "train.jsonl"}, "data.path='train.jsonl': only file tasks"),
        ({"data__task": "countdown", "data__shuffle": False}, "data.shuffle=False: only file"),
        ({"data__task_options": "{oops"}, "data.task_options is not valid JSON"),
        ({"data__task_options": '{"path": "x"}'}, "data.task_options sets ['path']"),
        ({"data__max_prompt_tokens": 128, "rollout__max_prefill_length": 64}, "exceeds"),
        ({"rollout__max_new_tokens": 0}, "rollout.max_new_tokens must be >= 1"),
        ({"learner__lr": -1.0}, "learner.lr must be finite and >= 0"),
    ],
)
def test_every_name_valued_option_is_checked_before_the_model_loads(overrides, message):
    with pytest.raises(ConfigError) as err:
        _exp(**overrides)
    assert message in str(err.value)


def test_an_hf_model_path_missing_its_files_is_one_config_line(tmp_path):
    # Issue 31: an existing empty directory as model.path was a 31-line traceback
    # from the tokenizer load; the line names the path and every file it lacks.
    with pytest.raises(ConfigError) as err:
        _exp(model__source="hf", model__path=str(tmp_path))
    assert str(err.value) == (
        f"model.path={str(tmp_path)!r} (model.source=hf) has no config.json and no "
        "tokenizer.json and no model.safetensors (or model.safetensors.index.json): "
        "a Hugging Face checkpoint directory holds all of them"
    )
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        (tmp_path / name).write_text("{}")
    assert _exp(model__source="hf", model__path=str(tmp_path)).model.path == str(tmp_path)


def test_unknown_keys_of_a_config_file_name_the_nearest_one():
    c = smoke.get_config().to_dict()
    c["data"]["pth"] = "x.jsonl"
    with pytest.raises(
        ConfigError, match=r"unknown config key 'data.pth' \(did you mean 'data.path'"
    ):
        ExperimentConfig.from_config_dict(c)


def test_the_task_picks_its_own_reward_unless_one_is_set():
    assert _exp().reward.fn == "math"
    assert _exp(data__task="countdown").reward.fn == "reasoning_gym"
    assert _exp(data__task="reasoning_gym:chain_sum").reward.fn == "reasoning_gym"
    assert _exp(data__task="countdown", reward__fn="uppercase_fraction").reward.fn == (
        "uppercase_fraction"
    )
    exp = _exp(data__task="countdown", data__task_options='{"config": {"max_numbers": 3}}')
    assert exp.data.task_kwargs() == {"config": {"max_numbers": 3}}
    exp = _exp(
        data__task="file",
        data__path=os.path.join(REPO, "README.md"),
        data__prompt_key="question",
        data__answer_marker="####",
        data__shuffle=False,
    )
    assert exp.data.task_kwargs() == {
        "path": os.path.join(REPO, "README.md"),
        "shuffle": False,
        "on_error": "skip",
        "prompt_key": "question",
        "answer_marker": "####",
    }


def test_json_objects_for_mapping_fields_become_python_literals():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "launch_overrides", os.path.join(REPO, "launch", "overrides.py")
    )
    overrides = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overrides)
    json_mappings = overrides.json_mappings
    config = ["--config", os.path.join(REPO, "configs", "smoke.py")]
    argv = [
        *config,
        """--config.learner.loss_kwargs={"dual_clip_c": null, "clip_eps_low": 0.2}""",
        "--config.learner.lr=1e-5",  # not a mapping: unchanged
        "--config.learner.loss_kwargs={'clip_eps_low': None}",  # Python form: unchanged
    ]
    out = json_mappings(argv)
    assert out[2] == "--config.learner.loss_kwargs={'dual_clip_c': None, 'clip_eps_low': 0.2}"
    assert out[:2] == config and out[3:] == argv[3:]


def test_an_argument_that_is_not_a_flag_is_refused_in_one_line(capsys):
    # Issue 31: `make run ARGS="config.total_steps=1"` (no --) ran the config's own
    # number of steps: absl hands back what is not a flag, and it went unread.
    from absl import flags

    from launch.overrides import parse_flags

    fv = flags.FlagValues()
    flags.DEFINE_string("workdir", None, "Run directory.", flag_values=fv)
    assert parse_flags(["tpu_pod.py", "--workdir=w"], fv) == ["tpu_pod.py"]
    for argv, line in [
        (
            ["tpu_pod.py", "--workdir=w", "config.total_steps=1"],
            "unrecognised argument 'config.total_steps=1': settings are flags, "
            "e.g. --config.total_steps=1",
        ),
        (
            ["tpu_pod.py", "--workdir=w", "--", "steps", "3"],
            "unrecognised argument 'steps' (and 1 more): settings are flags, "
            "e.g. --config.<key>=<value>",
        ),
    ]:
        with pytest.raises(SystemExit) as stop:
            parse_flags(argv, fv)
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"config error: {line}\n"


def _smoke_exp(**overrides):
    c = smoke.get_config()
    for key, value in overrides.items():
        *sections, field = key.split("__")
        node = c
        for s in sections:
            node = node[s]
        node[field] = value
    return ExperimentConfig.from_config_dict(c)


class _NoLearner:
    """Stands in for LearnerProgram: the start-up lines come before the learner state."""

    def __init__(self, *args, **kwargs):
        self.meta = types.SimpleNamespace(step=0)


@pytest.mark.parametrize(
    ("overrides", "says", "never"),
    [
        ({}, ["float32 params", "schedule: synchronous (rollout.async_ratio=0)"], ["LoRA"]),
        (
            {"mesh__colocated": False, "rollout__async_ratio": 2},
            ["schedule: asynchronous, staleness <= alpha = 2 (rollout.async_ratio)"],
            ["schedule: synchronous"],
        ),
        (
            {"learner__lora__rank": 16, "learner__lora__base_dtype": "int8"},
            [
                "QLoRA rank 16 (alpha 32) on q,k,v,o,gate,up,down: float32 adapters trained, "
                "the base frozen in int8"
            ],
            ["float32 params"],
        ),
        (
            {"learner__lora__rank": 4, "learner__lora__targets": "q,v"},
            ["LoRA rank 4 (alpha 32) on q,v: float32 adapters trained, the base frozen in float32"],
            ["float32 params", "QLoRA"],
        ),
    ],
)
def test_start_up_lines_name_the_schedule_and_what_is_trained(
    tmp_path, monkeypatch, overrides, says, never
):
    # Issue 31: an asynchronous run never named alpha; a LoRA/QLoRA run said "float32
    # params" and never LoRA, its rank or its int8 base.
    from jaxflash.runtime.fleet import learner_setup
    from jaxflash.runtime.model_setup import load_tokenizer

    monkeypatch.setattr(learner_setup, "LearnerProgram", _NoLearner)
    exp = _smoke_exp(**overrides)
    out = io.StringIO()
    placement = types.SimpleNamespace(learner=None)
    learner_setup.start_learner(
        exp, load_tokenizer(exp.model), placement, str(tmp_path), Console(out)
    )
    text = out.getvalue()
    for s in says:
        assert s in text, text
    for s in never:
        assert s not in text, text


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        (5, "no held-out evaluation: data.task='file' held out 0 of the data.eval_size=8 rows "
            "asked for (5 training rows); a file holds out at most 10 % of its rows"),
        (30, "held-out evaluation on 3 prompts only: data.task='file' held out 3 of the "
             "data.eval_size=8 rows asked for (27 training rows)"),
        (100, None),
    ],
)  # fmt: skip
def test_a_data_file_too_small_for_the_held_out_split_says_so(tmp_path, rows, says):
    # Issue 31: a small file ran with no evaluation and no message.
    from jaxflash.runtime.workloads.workload import make_workload

    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(f'{{"prompt": "{i} + 1?", "answer": "{i + 1}"}}\n' for i in range(rows))
    )
    exp = _smoke_exp(data__task="file", data__path=str(path))
    out = io.StringIO()
    _, workload = make_workload(exp, Console(out))
    text = out.getvalue()
    if says is None:
        assert "held-out" not in text and workload.held_out.size == 8, text
    else:
        assert says in text, text
