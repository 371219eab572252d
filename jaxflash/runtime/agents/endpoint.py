"""The run's OpenAI-compatible HTTP endpoint (aiohttp, on its own thread and event loop).

Routes (every one needs ``Authorization: Bearer <the run's key>``, else 401 with
OpenAI's ``invalid_api_key`` body):

    GET  /v1/models                                   the served model
    POST /sessions/<id>/v1/chat/completions           a turn of session <id>
    POST /v1/chat/completions + X-Jaxflash-Session    the same, the session in a header
    GET  /sessions/<id>/v1/models

A chat request is checked (``envs.agent_chat.parse_chat_request``) and handed to its
session (``sessions.AgentSession``); the handler awaits the session's answer, so
the event loop never blocks and any number of sessions wait at once. A malformed
request is answered with OpenAI's error body and fails its session; an unknown or
ended session gets 404 / 400 ``session_closed``.

Binding: loopback (``127.0.0.1``) by default; a non-loopback address is refused with
a ``ValueError`` unless ``allow_remote`` (the key still guards every request). The key
is random per run (``secrets.token_urlsafe``) unless given.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import socket
import threading
import time
from typing import Any

from aiohttp import web

from jaxflash.envs.agent_chat import RequestError, parse_chat_request
from jaxflash.runtime.agents.sessions import SessionClosedError, SessionTable

SESSION_HEADER = "X-Jaxflash-Session"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to loopback addresses only."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _error(status: int, message: str, *, code: str, param: str | None = None) -> web.Response:
    err = RequestError(message, param=param, code=code, status=status)
    return web.json_response(err.body(), status=status)


class AgentEndpoint:
    """The HTTP server (module docstring).

    Args:
      sessions: the run's session table.
      api_key: the key every request must carry.
      model_name: the name ``/v1/models`` lists; a request naming another model gets 404
        ``model_not_found`` ("" accepts any).
      host, port: where to listen (port 0: a free port, read back in ``port``).
      allow_remote: permit a non-loopback ``host``.

    Raises:
      ValueError: ``host`` is not loopback and ``allow_remote`` is False; an empty key.
    """

    def __init__(
        self,
        sessions: SessionTable,
        *,
        api_key: str,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_remote: bool = False,
    ) -> None:
        if not allow_remote and not is_loopback(host):
            raise ValueError(
                f"agent endpoint: host {host!r} is not a loopback address; set "
                "env.options.allow_remote=True to serve other machines"
            )
        if not api_key:
            raise ValueError("agent endpoint: an empty api_key")
        self.sessions, self.api_key, self.model_name = sessions, api_key, model_name
        self.host, self.port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.requests = 0  # chat requests answered (any status)

    # ------------------------------------------------------------------ life

    def start(self) -> AgentEndpoint:
        """Serve on a daemon thread; returns once listening."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._listen())
            except BaseException as e:  # noqa: BLE001 -- handed to start()'s caller
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="agent-endpoint", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            if isinstance(failure[0], OSError):  # e.g. the port is taken: name the setting
                raise ValueError(
                    f"agent endpoint: cannot listen on {self.host}:{self.port} "
                    f"(env.options.host / env.options.port): {failure[0]}"
                ) from failure[0]
            raise failure[0]
        return self

    async def _listen(self) -> None:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 2**20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the port chosen for 0

    def close(self) -> None:
        """Stop serving (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:  # handlers still waiting on a session are cut off after shutdown_timeout
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(timeout=10)
        except (TimeoutError, concurrent.futures.TimeoutError):
            pass
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of session ``session_id``.

        A wildcard host (``0.0.0.0``, ``::``: every interface, with ``allow_remote``)
        is not an address an agent can connect to: the URL names this machine's host
        name instead.
        """
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:  # an IPv6 literal
            host = f"[{host}]"
        return f"http://{host}:{self.port}/sessions/{session_id}/v1"

    # ------------------------------------------------------------------ handlers

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        want = f"Bearer {self.api_key}"
        if not hmac.compare_digest(given.encode(), want.encode()):
            return _error(401, "Incorrect API key provided", code="invalid_api_key")
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        del request
        model = {"id": self.model_name, "object": "model", "created": int(time.time()),
                 "owned_by": "jaxflash"}  # fmt: skip
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        sid = request.match_info.get("sid") or request.headers.get(SESSION_HEADER, "")
        if not sid:
            return _error(
                400,
                f"no session: use the base URL /sessions/<id>/v1 or the {SESSION_HEADER} header",
                code="session_missing",
            )
        session = self.sessions.get(sid)
        if session is None:
            return _error(404, f"session {sid!r} does not exist or has ended",
                          code="session_not_found")  # fmt: skip
        try:
            body = json.loads(await request.read())
            chat = parse_chat_request(body)
            if self.model_name and chat.model != self.model_name:
                raise RequestError(
                    f"the model {chat.model!r} does not exist; this endpoint serves "
                    f"{self.model_name!r}",
                    param="model",
                    code="model_not_found",
                    status=404,
                )
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            err = RequestError(f"the body is not valid JSON: {e}", code="invalid_json")
            session.post("malformed", err)
            return web.json_response(err.body(), status=err.status)
        except RequestError as e:
            session.post("malformed", e)
            return web.json_response(e.body(), status=e.status)
        try:
            future = session.post_request(chat)
        except SessionClosedError:
            return _error(400, f"session {sid!r} has ended", code="session_closed")
        status, payload = await asyncio.wrap_future(future)
        return web.json_response(payload, status=status)
