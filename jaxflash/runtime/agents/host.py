"""A run's agent host: the agent and task functions loaded, the endpoint started, and a
fresh ``sessions.AgentEnv`` per episode (``make_env``).

One host per run (``runtime.workloads.agentic`` builds it for ``env.name="agent"``);
it owns the endpoint and the session table, and reports the table's counters as the
step's ``agent`` section. ``close`` stops the endpoint.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from jaxflash.envs.agent_contract import AgentConfig, load_callable
from jaxflash.runtime.agents.endpoint import AgentEndpoint
from jaxflash.runtime.agents.sessions import (
    CLIENT_TIMEOUT_S,
    AgentEnv,
    AgentRuntime,
    SessionTable,
)


def openai_client(base_url: str, api_key: str, is_async: bool) -> Any:
    """The stock ``openai`` client for one session: no retries (a retried turn would be
    a second turn), a long timeout (a busy run queues turns)."""
    import openai  # noqa: PLC0415  (only agent runs need it)

    cls = openai.AsyncOpenAI if is_async else openai.OpenAI
    return cls(base_url=base_url, api_key=api_key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


class AgentHost:
    """The endpoint and the sessions of a run.

    Args:
      config: the ``agent`` environment's config (any split).
      api_key: the run's key ("" = a random one).
      client_factory: how a session's client is made (default ``openai_client``).

    Raises:
      AgentContractError: ``agent`` / ``tasks`` do not resolve (names the option).
      ValueError: the endpoint's host is not loopback and ``allow_remote`` is False,
        or it cannot listen there (the port is taken).
    """

    def __init__(self, config: AgentConfig, *, api_key: str = "", client_factory=None) -> None:
        self.config = config
        agent = load_callable(config.agent, "env.options.agent")
        tasks = load_callable(config.tasks, "env.options.tasks")
        self.table = SessionTable()
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.endpoint = AgentEndpoint(
            self.table, api_key=self.api_key, model_name=config.model_name, host=config.host,
            port=config.port, allow_remote=config.allow_remote,
        ).start()  # fmt: skip
        self.runtime = AgentRuntime(
            agent=agent, tasks=tasks, table=self.table, base_url=self.endpoint.base_url,
            api_key=self.api_key, model_name=config.model_name,
            client_factory=client_factory or openai_client,
        )  # fmt: skip

    def make_env(self, split: str = "train", **fields: Any) -> AgentEnv:
        """A fresh session's environment of ``split`` (fields override the config's)."""
        return AgentEnv(self.runtime, dataclasses.replace(self.config, split=split, **fields))

    def counts(self) -> dict[str, int]:
        """The sessions' counters (``sessions.SessionTable.counts``) and requests served."""
        return {**self.table.counts(), "agent_http_requests": self.endpoint.requests}

    def describe(self) -> str:
        """One console line."""
        return (
            f"agent {self.config.agent} on tasks {self.config.tasks}, endpoint "
            f"http://{self.endpoint.host}:{self.endpoint.port}/sessions/<id>/v1"
        )

    def close(self) -> None:
        """Stop the endpoint."""
        self.endpoint.close()
