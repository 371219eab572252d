"""The environments: FrozenLake, Sokoban, latency, registry, calibration (tools: test_tool_env)."""

import collections
import dataclasses
import math
import typing

import gymnasium
import numpy as np
import pytest

from jaxflash.envs.actions import parse_action, parse_answer, parse_choice, parse_first_word
from jaxflash.envs.base import EnvConfig, EnvOptionError, StepResult
from jaxflash.envs.calibration import calibrate_success
from jaxflash.envs.chat import TurnRenderer
from jaxflash.envs.frozenlake import (
    FrozenLakeConfig,
    FrozenLakeEnv,
    frozenlake_map,
    in_eval_part,
    render_frozenlake,
)
from jaxflash.envs.latency import LatencyConfig, LatencyEnv
from jaxflash.envs.registry import ENVIRONMENTS, env_config, make_env
from jaxflash.envs.sokoban import ACTION_NAMES as SOKOBAN_ACTIONS
from jaxflash.envs.sokoban import SokobanConfig, SokobanEnv, sokoban_level
from jaxflash.types import SamplingParams
from tests.envs_fixtures import chatml_tokenizer, scripted_policy

MOVE = {"U": "Up", "D": "Down", "L": "Left", "R": "Right"}


def test_parse_answer_takes_the_last_complete_tag():
    assert parse_answer("think <answer>Left</answer> no, <ANSWER> up </answer>") == "up"
    assert parse_answer("<answer>Left") is None and parse_answer("Left") is None
    assert parse_choice("<answer> rIGHT </answer>", ("Left", "Right")) == 1
    assert parse_choice("<answer>Rightwards</answer>", ("Left", "Right")) is None


FL_ACTIONS = ("Left", "Down", "Right", "Up")


@pytest.mark.parametrize(
    "text, want",
    [
        ("Down", "Down"),
        ("down.", "Down"),
        ("  UP\n", "Up"),
        ("**Right**", "Right"),
        ('"Left"', "Left"),
        ("Right-ish", "Right"),  # the word ends at the hyphen
        ("Down\n\nThe way to win is to go left", "Down"),  # the first word commits
        ("Right. Right is the way", "Right"),  # the same move named twice
    ],
)
def test_parse_first_word_accepts_the_move_as_first_word(text, want):
    assert parse_first_word(text, FL_ACTIONS) == FL_ACTIONS.index(want)
    assert parse_action(text, FL_ACTIONS, "first_word") == FL_ACTIONS.index(want)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "Leftmost",  # a longer word is not the action
        "Left2",
        "The answer is Up",  # prose before the move
        "You cannot move to either Down or Up",
        "1. Left",  # a number is a first word
        "_ _ G\nP O _",  # a grid
        "<answer>Down</answer>",  # the tag format is not this format
        "Jump",
        "Left, Down, Right or Up",  # the options echoed back: no move chosen
        "LEFT, Down, Up",
        "Up or down",
    ],
)
def test_parse_first_word_rejects_anything_else(text):
    assert parse_first_word(text, FL_ACTIONS) is None


def test_parse_action_dispatches_and_refuses_unknown_formats():
    assert parse_action("<answer>up</answer>", FL_ACTIONS, "answer_tag") == 3
    assert parse_action("Up", FL_ACTIONS, "answer_tag") is None
    with pytest.raises(ValueError, match="action_format"):
        parse_action("Up", FL_ACTIONS, "last_word")
    with pytest.raises(TypeError, match="text"):
        parse_first_word(None, FL_ACTIONS)


# ---------------------------------------------------------------------------- FrozenLake


def test_frozenlake_maps_are_deterministic_and_splits_disjoint():
    kw = dict(size=4, p_frozen=0.8, eval_fraction=0.2)
    train = {tuple(frozenlake_map(i, split="train", **kw)) for i in range(300)}
    evals = {tuple(frozenlake_map(i, split="eval", **kw)) for i in range(300)}
    assert train.isdisjoint(evals)
    assert all(in_eval_part(list(m), 0.2) for m in evals)
    assert not any(in_eval_part(list(m), 0.2) for m in train)
    assert len(evals) > 100  # held-out maps are many distinct maps, not one repeated
    assert frozenlake_map(17, split="eval", **kw) == frozenlake_map(17, split="eval", **kw)


def test_frozenlake_render_symbols():
    env = gymnasium.make("FrozenLake-v1", desc=["SFFF", "FHFH", "FFFH", "HFFG"], is_slippery=False)
    env.reset(seed=0)
    assert render_frozenlake(env) == "P _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G"
    env.step(1)  # down
    env.step(2)  # right: into the hole
    assert render_frozenlake(env) == "_ _ _ _\n_ X _ O\n_ _ _ O\nO _ _ G"


def test_frozenlake_invalid_action_penalty_and_no_step():
    env = FrozenLakeEnv(FrozenLakeConfig())
    obs = env.reset(5)
    assert "<answer>" in obs and obs.endswith(render_frozenlake(env.gym_env))
    before = (env.gym_env.unwrapped.s, env.gym_env._elapsed_steps)
    for text in ("I go right", "<answer>Jump</answer>", "<answer>Right"):
        r = env.step(text)
        assert r.reward == -0.01 and r.info["invalid_action"] and not r.terminated
        assert (env.gym_env.unwrapped.s, env.gym_env._elapsed_steps) == before
    r = env.step("<answer>down</answer>")
    assert not r.info["invalid_action"] and env.gym_env._elapsed_steps == 1


def test_frozenlake_first_word_format_asks_and_parses_one_word():
    env = FrozenLakeEnv(FrozenLakeConfig(size=3, action_format="first_word"))
    obs = env.reset(1)
    question = "Answer with one word: Left, Down, Right or Up."
    assert obs.endswith(render_frozenlake(env.gym_env) + "\n" + question)
    assert "<answer>" not in obs
    before = (env.gym_env.unwrapped.s, env.gym_env._elapsed_steps)
    for text in ("<answer>Down</answer>", "I go down", "Downwards"):
        r = env.step(text)
        assert r.reward == -0.01 and r.info["invalid_action"] and not r.terminated
        assert "first word" in r.observation and r.observation.endswith(question)
        assert (env.gym_env.unwrapped.s, env.gym_env._elapsed_steps) == before
    r = env.step("right. Because")
    assert r.info["action"] == "Right" and env.gym_env._elapsed_steps == 1
    assert r.observation.startswith("You moved Right.") and r.observation.endswith(question)
    with pytest.raises(ValueError, match="action_format"):
        FrozenLakeConfig(action_format="tags")


def shortest_moves(grid_rows):
    """BFS over a rendered FrozenLake grid ("P _ O G" rows): the moves from P to G."""
    cells = [row.split(" ") for row in grid_rows]
    n = len(cells)
    start = next((r, c) for r in range(n) for c in range(n) if cells[r][c] == "P")
    steps = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
    prev, queue = {start: None}, collections.deque([start])
    while queue:
        r, c = queue.popleft()
        if cells[r][c] == "G":
            path, node = [], (r, c)
            while prev[node] is not None:
                node, move = prev[node]
                path.append(move)
            return path[::-1]
        for move, (dr, dc) in steps.items():
            nxt = (r + dr, c + dc)
            if (
                0 <= nxt[0] < n
                and 0 <= nxt[1] < n
                and nxt not in prev
                and cells[nxt[0]][nxt[1]] != "O"
            ):
                prev[nxt] = ((r, c), move)
                queue.append(nxt)
    raise AssertionError("no path")


def oracle_reply(tok, size):
    def reply(request):
        text = tok.decode(request.prompt_tokens.tolist())
        last = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        return f"<answer>{shortest_moves(last.split(chr(10))[-size:])[0]}</answer>"

    return reply


def test_frozenlake_oracle_reaches_the_goal_and_slippery_is_reproducible():
    env = FrozenLakeEnv(FrozenLakeConfig(split="eval"))
    obs = env.reset(2)
    for move in shortest_moves(obs.split("\n")[-4:]):
        r = env.step(f"<answer>{move}</answer>")
    assert r.terminated and r.reward == 1.0 and r.info["success"]
    runs = []
    for _ in range(2):
        env = FrozenLakeEnv(FrozenLakeConfig(is_slippery=True, max_turns=20))
        env.reset(9)
        run = []
        while len(run) < 6 and not (run and (run[-1].terminated or run[-1].truncated)):
            run.append(env.step("<answer>Right</answer>"))
        runs.append([(r.observation, r.reward, r.terminated) for r in run])
    assert runs[0] == runs[1]


def test_frozenlake_calibration_mean_at_n_with_stderr():
    tok = chatml_tokenizer()
    renderer = TurnRenderer(tok)
    cfg = FrozenLakeConfig(split="eval", max_turns=8)
    oracle = oracle_reply(tok, 4)
    kw = dict(
        seeds=[0, 1, 2, 3],
        n=2,
        sampling=SamplingParams(temperature=1.0),
        max_context_tokens=4096,
        episodes_per_batch=3,
    )
    res = calibrate_success(
        lambda: FrozenLakeEnv(cfg), renderer, scripted_policy(tok, oracle), **kw
    )
    assert res.success_mean == 1.0 and res.success_stderr == 0.0 and res.episodes == 8
    assert res.invalid_action_rate == 0.0

    # Even maps solved, odd maps never (invalid actions until max_turns): per-map
    # [1, 0, 1, 0] -> mean 0.5, stderr = std([1, 0, 1, 0], ddof=1) / 2 = 0.288675.
    def half(request):
        return oracle(request) if request.prompt_id % 2 == 0 else "pass"

    res = calibrate_success(lambda: FrozenLakeEnv(cfg), renderer, scripted_policy(tok, half), **kw)
    assert res.per_seed.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert res.success_mean == 0.5 and res.success_stderr == pytest.approx(0.2886751, rel=1e-6)
    assert res.env_failures == 0 and res.seeds_excluded == 0

    class Flaky(FrozenLakeEnv):  # map 3's environment always crashes: counted, not a loss
        def step(self, action_text):
            if self._seed == 3:
                raise RuntimeError("lost connection")
            return super().step(action_text)

        def reset(self, seed):
            self._seed = seed
            return super().reset(seed)

    res = calibrate_success(lambda: Flaky(cfg), renderer, scripted_policy(tok, oracle), **kw)
    assert res.env_failures == 2 and res.seeds_excluded == 1 and res.seeds == (0, 1, 2)
    assert res.success_mean == 1.0


# ---------------------------------------------------------------------------- Sokoban


@pytest.fixture(scope="module")
def sokoban_cfg():
    return SokobanConfig(num_boxes=2, max_turns=40)


def test_sokoban_checked_solution_solves_with_gym_sokoban_rewards(sokoban_cfg):
    env = SokobanEnv(sokoban_cfg)
    env.reset(1)
    level = env.level
    start_on = sum(row.count("$") for row in level.grid)
    rewards = [env.step(f"<answer>{MOVE[m]}</answer>") for m in level.solution]
    assert rewards[-1].terminated and rewards[-1].info["success"]
    assert not any(r.terminated for r in rewards[:-1])
    # -0.1 per move, +1 / -1 per box on / off a target (telescopes), +10 at the end.
    want = -0.1 * len(level.solution) + (sokoban_cfg.num_boxes - start_on) + 10.0
    assert sum(r.reward for r in rewards) == pytest.approx(want)


def player_and_wall_move(grid):
    rows = [row.split(" ") for row in grid]
    pr, pc = next((i, j) for i, row in enumerate(rows) for j, ch in enumerate(row) if ch in "PS")
    offsets = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
    return [a for a in SOKOBAN_ACTIONS if rows[pr + offsets[a][0]][pc + offsets[a][1]] == "#"]


def test_sokoban_invalid_action_and_wall_bump(sokoban_cfg):
    env = SokobanEnv(sokoban_cfg)
    for seed in range(50):  # a level whose player starts next to a wall
        grid = env.reset(seed).split("\n")[-sokoban_cfg.height :]
        if player_and_wall_move(grid):
            break
    r = env.step("<answer>North</answer>")
    assert r.reward == -0.15 and r.info["invalid_action"]
    assert r.observation.split("\n")[-sokoban_cfg.height :] == grid
    r = env.step(f"<answer>{player_and_wall_move(grid)[0]}</answer>")
    assert r.reward == pytest.approx(-0.1) and not r.info["moved"] and not r.info["invalid_action"]
    assert r.observation.split("\n")[-sokoban_cfg.height :] == grid


def test_sokoban_levels_deterministic_disjoint_and_nontrivial():
    cfg = SokobanConfig(min_solution_moves=4)
    train = [sokoban_level(i, cfg) for i in range(15)]
    evals = [sokoban_level(i, SokobanConfig(min_solution_moves=4, split="eval")) for i in range(15)]
    assert {lv.grid for lv in train}.isdisjoint({lv.grid for lv in evals})
    assert all(len(lv.solution) >= 4 for lv in train + evals)
    assert sokoban_level(3, cfg) == train[3]


# ---------------------------------------------------------------------------- latency


class Fixed:
    config = EnvConfig()

    def reset(self, seed):
        return "s"

    def step(self, action_text):
        return StepResult("o", 0.0, False, False, {})

    def close(self):
        pass


def draws(cfg, seed, n):
    slept = []
    env = LatencyEnv(Fixed(), cfg, sleep=slept.append)
    env.reset(seed)
    infos = [env.step("a").info["latency_s"] for _ in range(n)]
    return slept, infos, env


def test_latency_truncated_normal_reproducible_and_reported():
    cfg = LatencyConfig(mean_s=1.0, std_s=1.0, seed=3)
    slept, infos, env = draws(cfg, 5, 20000)
    assert slept == [x for x in infos if x > 0] and min(infos) >= 0
    # E[X | X >= 0] for N(1, 1) = 1 + phi(-1) / (1 - Phi(-1)) = 1 + 0.241971 / 0.841345.
    assert np.mean(infos) == pytest.approx(1.287600, abs=0.03)
    assert draws(cfg, 5, 50)[1] == infos[:50]  # same (seed, episode seed): same latencies
    assert draws(cfg, 6, 50)[1] != infos[:50]
    assert env.config is Fixed.config
    assert draws(LatencyConfig(mean_s=0.25), 1, 3)[1] == [0.25, 0.25, 0.25]


def test_latency_stragglers_scale_every_step():
    base = draws(LatencyConfig(mean_s=1.0, std_s=0.5, straggler_prob=1.0, seed=1), 2, 10)
    slow = draws(
        LatencyConfig(mean_s=1.0, std_s=0.5, straggler_prob=1.0, straggler_factor=5.0, seed=1),
        2,
        10,
    )
    np.testing.assert_allclose(slow[1], 5 * np.asarray(base[1]))
    assert slow[2].is_straggler and not base[2].is_straggler
    flags = []
    for s in range(400):
        env = LatencyEnv(Fixed(), LatencyConfig(straggler_prob=0.125, straggler_factor=3.0))
        env.reset(s)
        flags.append(env.is_straggler)
    assert (
        0.125 - 3 * math.sqrt(0.125 * 0.875 / 400)
        < np.mean(flags)
        < 0.125 + 3 * math.sqrt(0.125 * 0.875 / 400)
    )


# ---------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: EnvConfig(max_turns=0), "max_turns"),
        (lambda: EnvConfig(max_tokens_per_turn=0), "max_tokens_per_turn"),
        (lambda: EnvConfig(step_timeout_s=0), "step_timeout_s"),
        (lambda: EnvConfig(invalid_action_penalty=0.5), "invalid_action_penalty"),
        (lambda: FrozenLakeConfig(size=1), "size"),
        (lambda: FrozenLakeConfig(split="test"), "split"),
        (lambda: SokobanConfig(num_boxes=9), "num_boxes"),
        (lambda: SokobanConfig(min_solution_moves=50), "min_solution_moves"),
        (lambda: LatencyConfig(std_s=-1), "std_s"),
        (lambda: LatencyConfig(straggler_factor=0.5), "straggler_factor"),
        (lambda: env_config("frozenlake", size=4, slippery=True), "slippery"),
        (lambda: make_env("atari"), "atari"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


_WRONG_TYPED = {  # per annotated type: values of the wrong type (bool is not an int)
    int: (2.5, True, "3", None),
    float: ("abc", True, float("nan"), None),
    bool: ("yes", 1, None),
    str: (3, None),
}


def _wrong_values(hint):
    if typing.get_origin(hint) is typing.Literal:
        return ("no_such_choice", 3, None)
    return _WRONG_TYPED[hint]


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_every_option_of_every_environment_is_type_checked(name):
    """Each field of each shipped environment's config refuses each wrong type with an
    EnvOptionError naming the field and the value (``max_turns=2.5`` used to pass and
    fail every group at request time)."""
    config_cls = ENVIRONMENTS[name][0]
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        for bad in _wrong_values(hints[f.name]):
            with pytest.raises(EnvOptionError) as info:
                env_config(name, **{f.name: bad})
            assert info.value.field == f.name, (f.name, bad)
            assert repr(bad) in str(info.value) and f.name in str(info.value)


def test_ints_are_fine_floats_and_bools_are_bools():
    cfg = env_config("frozenlake", step_timeout_s=30, p_frozen=1, is_slippery=True)
    assert cfg.step_timeout_s == 30 and cfg.is_slippery is True


def test_registry_builds_each_environment():
    env = make_env("frozenlake", size=4, split="eval", latency=LatencyConfig(mean_s=0.0))
    assert isinstance(env, LatencyEnv) and env.config.split == "eval"
    assert "<answer>" in env.reset(0)
    assert make_env("sokoban").config.invalid_action_penalty == -0.15
    assert make_env("frozenlake").config.invalid_action_penalty == -0.01
    assert make_env("tool_use").config.max_turns >= 2
