"""FrozenLake (gymnasium's ``FrozenLake-v1``) as a text game with held-out maps.

The map of episode ``seed`` is the ``seed``-th map of the configured split, drawn
by gymnasium's ``generate_random_map`` (every map it makes has a path from S to G).
Train and eval never share a map: each map's text is hashed (BLAKE2b, stable across
processes) into the eval part (fraction ``eval_fraction``) or the train part of the
map space, and a split rejection-samples candidate maps until it draws one of its
own part -- disjoint by construction, not by luck of the seed. The seed also seeds
gymnasium's transition RNG, so a slippery episode is reproducible.

Text (as in ROLL, arXiv 2510.11345): one row per line, cells separated by spaces,
``P`` the player, ``_`` frozen ice (the start cell included), ``O`` a hole, ``G``
the goal, ``X`` the player in a hole, ``√`` the player on the goal. Actions
(``action_format``): ``<answer>Left|Down|Right|Up</answer>`` (ROLL's), or the
reply's first word ``Left|Down|Right|Up`` (for models too small to keep the tag
format; every state is followed by the question "Answer with one word: Left, Down,
Right or Up."). Reward 1.0 on reaching the goal, else 0; an invalid action costs
``invalid_action_penalty`` (-0.01) and does not move.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

import gymnasium
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from jaxflash.envs.actions import ACTION_FORMATS, ActionFormat
from jaxflash.envs.base import EnvConfig
from jaxflash.envs.gym_adapter import GymTextEnv

ACTION_NAMES = ("Left", "Down", "Right", "Up")  # gymnasium's action order 0..3
_CELL = {b"S": "_", b"F": "_", b"H": "O", b"G": "G"}
_PLAYER_ON = {b"S": "P", b"F": "P", b"H": "X", b"G": "√"}
_MAX_TRIES = 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrozenLakeConfig(EnvConfig):
    """FrozenLake knobs (plus the common limits of ``EnvConfig``).

    Attributes:
      size: the map is size x size (>= 2).
      p_frozen: probability that a generated cell is frozen (safe), in (0, 1].
      is_slippery: gymnasium's slippery ice (the move goes sideways with prob. 2/3).
      split: "train" or "eval" map set.
      eval_fraction: share of the map space held out for eval, in (0, 1).
      invalid_action_penalty: ROLL's -0.01.
      action_format: "answer_tag" (ROLL's ``<answer>Right</answer>``) or "first_word"
        (the reply's first word; see ``envs.actions``).
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 100
    invalid_action_penalty: float = -0.01
    size: int = 4
    p_frozen: float = 0.8
    is_slippery: bool = False
    split: Literal["train", "eval"] = "train"
    eval_fraction: float = 0.2
    action_format: ActionFormat = "answer_tag"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require(
            "action_format", self.action_format in ACTION_FORMATS, f"one of {ACTION_FORMATS}"
        )
        self.require("size", self.size >= 2, "an int >= 2")
        self.require("p_frozen", 0.0 < self.p_frozen <= 1.0, "a number in (0, 1]")
        self.require("eval_fraction", 0.0 < self.eval_fraction < 1.0, "a number in (0, 1)")


def in_eval_part(map_rows: list[str], eval_fraction: float) -> bool:
    """Whether a map (its rows, e.g. ``["SFFF", ...]``) belongs to the held-out part."""
    digest = hashlib.blake2b("\n".join(map_rows).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < eval_fraction


def frozenlake_map(
    index: int,
    *,
    size: int,
    p_frozen: float,
    split: Literal["train", "eval"],
    eval_fraction: float,
) -> list[str]:
    """The ``index``-th map of a split (deterministic in all arguments).

    Args:
      index: map number within the split (>= 0), the episode seed.
      size, p_frozen, split, eval_fraction: as in ``FrozenLakeConfig``.

    Returns:
      the map rows, e.g. ``["SFFF", "FHFH", "FFFH", "HFFG"]``.

    Raises:
      ValueError: negative index, or no map of this split within 1000 candidates
        (the map space is too small for the split; use a larger ``size``).
    """
    if index < 0:
        raise ValueError(f"frozenlake_map: index must be >= 0, got {index}")
    want_eval = split == "eval"
    for attempt in range(_MAX_TRIES):
        # Candidate seeds of different indices never collide: attempt < _MAX_TRIES.
        rows = generate_random_map(size=size, p=p_frozen, seed=index * _MAX_TRIES + attempt)
        if in_eval_part(rows, eval_fraction) == want_eval:
            return rows
    raise ValueError(
        f"frozenlake_map: no {split} map among {_MAX_TRIES} candidates for size={size}, "
        f"p_frozen={p_frozen}, eval_fraction={eval_fraction}"
    )


def render_frozenlake(env: gymnasium.Env) -> str:
    """Text of a FrozenLake state (symbols in the module docstring)."""
    lake = env.unwrapped
    desc, ncol, pos = lake.desc, lake.ncol, int(lake.s)
    rows = []
    for r, row in enumerate(desc):
        cells = []
        for c, cell in enumerate(row):
            cell = bytes(cell)
            cells.append(_PLAYER_ON[cell] if r * ncol + c == pos else _CELL[cell])
        rows.append(" ".join(cells))
    return "\n".join(rows)


# Asked after every state in the first_word format: SmolLM2-135M-Instruct answers a
# direct one-word question with a word far more often than it writes a tag format
# (calibration in configs/agentic_frozenlake.py).
_FIRST_WORD_QUESTION = "Answer with one word: Left, Down, Right or Up."


def _instructions(config: FrozenLakeConfig) -> str:
    slip = (
        " The ice is slippery: you may slide to a side instead of where you meant to go."
        if config.is_slippery
        else ""
    )
    if config.action_format == "first_word":
        return (
            "Move P to the goal G on this grid without stepping on a hole O "
            f"(_ is safe ice). Each turn you move one cell.{slip}"
        )
    return (
        "You are on a frozen lake. Walk from your position P to the goal G without "
        "falling into a hole O. Symbols: P you, _ frozen ice, O hole, G goal. Each turn "
        f"you move one cell: Left, Down, Right or Up.{slip} Think briefly, then give your "
        "move as <answer>Right</answer> (or Left, Down, Up)."
    )


class FrozenLakeEnv(GymTextEnv):
    """gymnasium FrozenLake-v1 over text; ``reset(seed)`` plays map ``seed`` of the split."""

    def __init__(self, config: FrozenLakeConfig | None = None) -> None:
        config = config or FrozenLakeConfig()

        def make(seed: int) -> gymnasium.Env:
            rows = frozenlake_map(
                seed,
                size=config.size,
                p_frozen=config.p_frozen,
                split=config.split,
                eval_fraction=config.eval_fraction,
            )
            return gymnasium.make("FrozenLake-v1", desc=rows, is_slippery=config.is_slippery)

        super().__init__(
            make,
            config=config,
            action_names=ACTION_NAMES,
            render=render_frozenlake,
            instructions=_instructions(config),
            is_success=lambda env, reward, terminated: terminated and reward > 0,
            action_format=config.action_format,
            state_suffix=_FIRST_WORD_QUESTION if config.action_format == "first_word" else "",
        )
