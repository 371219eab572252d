"""Any gymnasium environment with a discrete action space, as a text environment.

The adapter owns the text conventions; the gymnasium environment owns the
dynamics. Per turn: the action is parsed by the environment's ``action_format``
(``envs.actions``): the last ``<answer>NAME</answer>`` of the response, or its
first word; NAME one of ``action_names`` (any case). A response without a valid
action gets ``config.invalid_action_penalty``, ``info["invalid_action"] = True``
and an observation saying so, and the gymnasium environment is NOT stepped (ROLL's
convention, arXiv 2510.11345).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium

from jaxflash.envs.actions import ACTION_FORMATS, ActionFormat, parse_action
from jaxflash.envs.base import EnvConfig, StepResult

MakeGymEnv = Callable[[int], gymnasium.Env]
"""seed -> a fresh gymnasium environment (the seed may choose its map or level)."""


class GymTextEnv:
    """A discrete-action gymnasium environment spoken to in text.

    Args:
      make_env: seed -> gymnasium.Env (called at every reset; the old one is closed).
      config: limits and the invalid-action penalty.
      action_names: name of each discrete action, in action-index order.
      render: gymnasium env -> text of its current state.
      instructions: text shown before the first state (rules, action format).
      is_success: (env, reward, terminated) -> whether the episode was won; stored
        as ``info["success"]`` on the step that ends the episode.
      action_format: how the action is read from a response (``envs.actions``).
      state_suffix: text after every rendered state (e.g. the question the policy
        answers: ``"Move:"``), in the first observation and every later one.

    Raises:
      ValueError: duplicate action names, an unknown ``action_format``; (at reset)
        the action space is not Discrete(len(action_names)).
    """

    def __init__(
        self,
        make_env: MakeGymEnv,
        *,
        config: EnvConfig,
        action_names: Sequence[str],
        render: Callable[[gymnasium.Env], str],
        instructions: str,
        is_success: Callable[[gymnasium.Env, float, bool], bool],
        action_format: ActionFormat = "answer_tag",
        state_suffix: str = "",
    ) -> None:
        if len({a.lower() for a in action_names}) != len(action_names):
            raise ValueError(f"GymTextEnv: action_names must be distinct, got {action_names}")
        if action_format not in ACTION_FORMATS:
            raise ValueError(
                f"GymTextEnv: action_format must be one of {ACTION_FORMATS}, got {action_format!r}"
            )
        self._action_format: ActionFormat = action_format
        self._state_suffix = state_suffix
        self.config = config
        self._make_env = make_env
        self._action_names = tuple(action_names)
        self._render = render
        self._instructions = instructions
        self._is_success = is_success
        self._env: gymnasium.Env | None = None
        self._done = False

    @property
    def gym_env(self) -> gymnasium.Env:
        """The current gymnasium environment (after ``reset``)."""
        if self._env is None:
            raise RuntimeError("GymTextEnv: call reset(seed) first")
        return self._env

    def reset(self, seed: int) -> str:
        """Start the episode of ``seed``; returns the instructions and the first state."""
        self.close()
        env = self._make_env(seed)
        space = env.action_space
        if not isinstance(space, gymnasium.spaces.Discrete) or space.n != len(self._action_names):
            env.close()
            raise ValueError(
                f"GymTextEnv: action space {space} does not match action_names {self._action_names}"
            )
        env.reset(seed=seed)
        self._env, self._done = env, False
        return f"{self._instructions}\n{self._state(env)}"

    def _state(self, env: gymnasium.Env) -> str:
        suffix = f"\n{self._state_suffix}" if self._state_suffix else ""
        return f"{self._render(env)}{suffix}"

    def step(self, action_text: str) -> StepResult:
        """One turn: parse the action, step the gymnasium environment (if valid)."""
        env = self.gym_env
        if self._done:
            raise RuntimeError("GymTextEnv: step after the episode ended; call reset")
        index = parse_action(action_text, self._action_names, self._action_format)
        if index is None:
            names = ", ".join(self._action_names)
            how = (
                "inside <answer></answer>"
                if self._action_format == "answer_tag"
                else "as the first word of your reply"
            )
            obs = f"Invalid action: answer with exactly one of {names} {how}.\n{self._state(env)}"
            info: dict[str, Any] = {"invalid_action": True, "action": None}
            return StepResult(obs, float(self.config.invalid_action_penalty), False, False, info)
        _, reward, terminated, truncated, gym_info = env.step(index)
        reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        self._done = terminated or truncated
        info = dict(gym_info)
        info.update(invalid_action=False, action=self._action_names[index])
        if self._done:
            info["success"] = bool(self._is_success(env, reward, terminated))
        obs = f"You moved {self._action_names[index]}.\n{self._state(env)}"
        return StepResult(obs, reward, terminated, truncated, info)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
