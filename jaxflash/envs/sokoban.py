"""Sokoban as a text game over solver-checked levels from reasoning-gym.

Levels come from reasoning-gym's Sokoban generator (``reasoning_gym.games.contrib.
sokoban``, MIT): it builds a level by pulling boxes backwards from their goals and
keeps it only when its A* solver finds a solution within ``max_solution_depth``
moves, so every level is solvable and ships with a checked solution
(``info["solution"]``). A level whose solution is shorter than
``min_solution_moves`` is skipped (the generator can place a box next to its goal).
Train and eval levels are disjoint by construction (the level text is hashed into
the eval part, fraction ``eval_fraction``, or the train part; see ``frozenlake``).
The moves are played by reasoning-gym's own ``Game`` (the same one its verifier
replays answers with).

Text (as in ROLL, arXiv 2510.11345, after gym-sokoban): ``#`` wall, ``_`` floor,
``O`` target, ``X`` box, ``√`` box on target, ``P`` player, ``S`` player on target.
Actions ``<answer>Up|Down|Left|Right</answer>``. Rewards (gym-sokoban's, as ROLL
uses them): -0.1 per move, +1 for a box pushed onto a target, -1 for one pushed off,
+10 when every box is on a target (the episode terminates); a move into a wall is a
valid move that changes nothing. An invalid action costs -0.15 and does not move.
"""

from __future__ import annotations

import dataclasses
import hashlib
from random import Random
from typing import Any, Literal

import numpy as np

from jaxflash.envs.actions import parse_choice
from jaxflash.envs.base import EnvConfig, StepResult

ACTION_NAMES = ("Up", "Down", "Left", "Right")
_KEYS = ("U", "D", "L", "R")  # reasoning-gym's move letters, same order
# reasoning-gym characters -> ROLL / gym-sokoban text symbols.
_SYMBOL = {"+": "#", "-": "_", "X": "O", "@": "X", "$": "√", "*": "P", "%": "S"}
_MAX_TRIES = 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class SokobanConfig(EnvConfig):
    """Sokoban knobs (plus the common limits of ``EnvConfig``).

    Attributes:
      width, height: level size including the outer walls (5..20).
      num_boxes: boxes (and targets) per level (>= 1).
      max_solution_depth: the solver's search depth; levels it cannot solve within it
        are regenerated (>= 2).
      min_solution_moves: skip levels whose checked solution is shorter (>= 1).
      split, eval_fraction: as in ``FrozenLakeConfig``.
      step_penalty, box_on_reward, box_off_penalty, finish_reward: gym-sokoban's.
      invalid_action_penalty: ROLL's -0.15.
    """

    max_turns: int = 20
    max_tokens_per_turn: int = 100
    invalid_action_penalty: float = -0.15
    width: int = 6
    height: int = 6
    num_boxes: int = 1
    max_solution_depth: int = 30
    min_solution_moves: int = 2
    split: Literal["train", "eval"] = "train"
    eval_fraction: float = 0.2
    step_penalty: float = -0.1
    box_on_reward: float = 1.0
    box_off_penalty: float = -1.0
    finish_reward: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("width", "height"):
            self.require(name, 5 <= getattr(self, name) <= 20, "an int in [5, 20]")
        interior = (self.width - 2) * (self.height - 2)
        self.require(
            "num_boxes",
            1 <= self.num_boxes <= interior // 4,
            f"an int in [1, {interior // 4}] for a {self.width}x{self.height} level",
        )
        self.require("max_solution_depth", self.max_solution_depth >= 2, "an int >= 2")
        self.require(
            "min_solution_moves",
            1 <= self.min_solution_moves <= self.max_solution_depth,
            f"an int in [1, max_solution_depth={self.max_solution_depth}]",
        )
        self.require("eval_fraction", 0.0 < self.eval_fraction < 1.0, "a number in (0, 1)")


@dataclasses.dataclass(frozen=True)
class SokobanLevel:
    """A generated level: ``grid`` rows of reasoning-gym characters and a checked solution."""

    grid: tuple[str, ...]
    solution: str  # moves as U/D/L/R letters


def _in_eval_part(grid: tuple[str, ...], eval_fraction: float) -> bool:
    digest = hashlib.blake2b("\n".join(grid).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < eval_fraction


def sokoban_level(index: int, config: SokobanConfig) -> SokobanLevel:
    """The ``index``-th level of ``config.split`` (deterministic in index and config).

    Raises:
      ValueError: negative index, or no level of this split within 1000 candidates.
    """
    from reasoning_gym.games.contrib.sokoban.src.generator import generate  # ~1.5 s import

    if index < 0:
        raise ValueError(f"sokoban_level: index must be >= 0, got {index}")
    want_eval = config.split == "eval"
    for attempt in range(_MAX_TRIES):
        text, solution, _ = generate(
            rng=Random(index * _MAX_TRIES + attempt),
            min_w=config.width,
            max_w=config.width,
            min_h=config.height,
            max_h=config.height,
            min_boxes=config.num_boxes,
            max_boxes=config.num_boxes,
            max_depth=config.max_solution_depth,
        )
        grid = tuple(line.replace(" ", "") for line in text.strip().split("\n"))
        if len(solution) < config.min_solution_moves:
            continue
        if _in_eval_part(grid, config.eval_fraction) == want_eval:
            return SokobanLevel(grid=grid, solution=solution)
    raise ValueError(f"sokoban_level: no {config.split} level among {_MAX_TRIES} candidates")


def render_sokoban(matrix: np.ndarray) -> str:
    """Text of a reasoning-gym character matrix (symbols in the module docstring)."""
    return "\n".join(" ".join(_SYMBOL[c] for c in row) for row in matrix)


class SokobanEnv:
    """Sokoban over text; ``reset(seed)`` plays level ``seed`` of the split."""

    def __init__(self, config: SokobanConfig | None = None) -> None:
        self.config = config or SokobanConfig()
        self._game: Any = None
        self._level: SokobanLevel | None = None
        self._done = False

    @property
    def level(self) -> SokobanLevel:
        if self._level is None:
            raise RuntimeError("SokobanEnv: call reset(seed) first")
        return self._level

    def _matrix(self) -> np.ndarray:
        return self._game.get_matrix()

    def reset(self, seed: int) -> str:
        from reasoning_gym.games.contrib.sokoban.src.game import Game

        level = sokoban_level(seed, self.config)
        grid = np.array([list(row) for row in level.grid])
        game = Game(height=grid.shape[0], width=grid.shape[1])
        game.load_puzzle_matrix(grid)
        self._game, self._level, self._done = game, level, False
        cfg = self.config
        return (
            "You are solving a Sokoban puzzle. Push every box X onto a target O. Symbols: "
            "# wall, _ floor, O target, X box, √ box on target, P you, S you on a target. "
            "Each turn you move one cell: Up, Down, Left or Right; walking into a box pushes "
            "it one cell if the cell behind it is free. You cannot pull boxes. Think briefly, "
            f"then give your move as <answer>Up</answer>. You have {cfg.max_turns} turns.\n"
            f"{render_sokoban(self._matrix())}"
        )

    def step(self, action_text: str) -> StepResult:
        if self._game is None:
            raise RuntimeError("SokobanEnv: call reset(seed) first")
        if self._done:
            raise RuntimeError("SokobanEnv: step after the episode ended; call reset")
        cfg = self.config
        index = parse_choice(action_text, ACTION_NAMES)
        if index is None:
            obs = (
                "Invalid action: answer with exactly one of Up, Down, Left, Right inside "
                f"<answer></answer>.\n{render_sokoban(self._matrix())}"
            )
            return StepResult(
                obs,
                float(cfg.invalid_action_penalty),
                False,
                False,
                {"invalid_action": True, "action": None},
            )
        before = int((self._matrix() == "$").sum())
        moved = bool(self._game.player.update(key=_KEYS[index]))
        matrix = self._matrix()
        after = int((matrix == "$").sum())
        reward = cfg.step_penalty
        reward += cfg.box_on_reward * max(after - before, 0)
        reward += cfg.box_off_penalty * max(before - after, 0)
        solved = not (matrix == "@").any()
        info: dict[str, Any] = {
            "invalid_action": False,
            "action": ACTION_NAMES[index],
            "moved": moved,
            "boxes_on_target": after,
        }
        if solved:
            reward += cfg.finish_reward
            info["success"] = True
            self._done = True
        what = f"You moved {ACTION_NAMES[index]}." if moved else "Blocked: you did not move."
        return StepResult(f"{what}\n{render_sokoban(matrix)}", float(reward), solved, False, info)

    def close(self) -> None:
        self._game = None
