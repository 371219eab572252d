"""Environments by name, built from plain keyword fields (what a config holds)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxflash.envs.agent_contract import AgentConfig
from jaxflash.envs.base import EnvConfig, TextEnv
from jaxflash.envs.frozenlake import FrozenLakeConfig, FrozenLakeEnv
from jaxflash.envs.latency import LatencyConfig, LatencyEnv
from jaxflash.envs.scienceworld import ScienceWorldConfig, ScienceWorldEnv
from jaxflash.envs.sokoban import SokobanConfig, SokobanEnv
from jaxflash.envs.tool_env import ToolUseConfig, ToolUseEnv


class _AgentSessions:
    """``agent`` episodes are sessions of the run's endpoint (``runtime.agents``)."""

    def __init__(self, config: AgentConfig) -> None:
        raise TypeError(
            "env 'agent' is played through the run's endpoint: "
            "jaxflash.runtime.agents.host.AgentHost(config).make_env()"
        )


ENVIRONMENTS: dict[str, tuple[type[EnvConfig], type]] = {
    "agent": (AgentConfig, _AgentSessions),
    "frozenlake": (FrozenLakeConfig, FrozenLakeEnv),
    "sokoban": (SokobanConfig, SokobanEnv),
    "scienceworld": (ScienceWorldConfig, ScienceWorldEnv),
    "tool_use": (ToolUseConfig, ToolUseEnv),
}


def env_config(name: str, **fields: Any) -> EnvConfig:
    """The config of environment ``name`` from keyword fields.

    Raises:
      ValueError: unknown name, or fields the config does not have (all named).
    """
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVIRONMENTS)}")
    config_cls = ENVIRONMENTS[name][0]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"{config_cls.__name__} has no fields {unknown}; its fields are {sorted(known)}"
        )
    return config_cls(**fields)


def make_env(name: str, *, latency: LatencyConfig | None = None, **fields: Any) -> TextEnv:
    """A new environment ``name`` (optionally wrapped in ``LatencyEnv``).

    Raises:
      ValueError: as ``env_config``.
    """
    config = env_config(name, **fields)
    env = ENVIRONMENTS[name][1](config)
    return env if latency is None else LatencyEnv(env, latency)
