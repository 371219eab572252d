"""One readable line for a bad ``--config.<key>=<value>`` override.

``ml_collections.config_flags`` reports an unknown key as a chained
KeyError/AttributeError traceback of ~55 lines whose last line holds an
escaped "Did you mean". ``parse_flags`` (an ``absl.app.run`` flags parser)
catches any error while the flags are parsed and explains it in one line: the
unknown key with the nearest known one (found here by walking the config the
``--config`` file builds; a key of a mapping-valued field such as
``replay.correction_kwargs`` also says how to give the whole mapping as JSON), or
the flag library's own message. An argument that is not a flag
(``config.total_steps=1``, without ``--``) is refused the same way: absl would hand it
back unread and the run would go on without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags

from jaxflash.runtime.config.specs import unknown_key_message


def _config_file(argv: Sequence[str]) -> tuple[str, str | None] | None:
    """(path, argument) of ``--config=path[:arg]`` / ``--config path[:arg]``."""
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
        if value:
            path, sep, config_arg = value.partition(":")
            return path, (config_arg if sep else None)
    return None


def _load_config(path: str, config_arg: str | None) -> Any:
    spec = importlib.util.spec_from_file_location("_jaxflash_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(config_arg) if config_arg is not None else module.get_config()


def unknown_override(argv: Sequence[str]) -> str | None:
    """The message for the first ``--config.<key>`` that names no config field, or None.

    Args:
      argv: the command line (``sys.argv``).
    """
    located = _config_file(argv)
    if located is None or not os.path.isfile(located[0]):
        return None
    try:
        config = _load_config(*located)
    except Exception:  # the flag parser reports a broken config file itself
        return None
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key, _, value = arg[len("--config.") :].partition("=")
        node: Any = config
        for depth, part in enumerate(key.split(".")):
            known = list(node.keys()) if hasattr(node, "keys") else []
            if part not in known:
                prefix = ".".join(key.split(".")[:depth])
                full = f"{prefix}.{part}" if prefix else part
                message = unknown_key_message(full, known)
                if depth >= 2 and (hasattr(node, "keys") or isinstance(node, str)):
                    message += _whole_mapping_hint(prefix, part, value)
                return message
            node = node[part]
    return None


def _whole_mapping_hint(field: str, key: str, value: str) -> str:
    """How to set a key of a mapping-valued field (``replay.correction_kwargs``,
    ``learner.loss_kwargs``, ``env.options``): the flag library cannot add a key to a
    mapping, but takes the whole mapping as one JSON value."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    example = json.dumps({key: parsed})
    return (
        f"; {field} is a mapping: a key it does not have is set by giving the whole "
        f"mapping as JSON, e.g. --config.{field}='{example}'"
    )


def json_mappings(argv: list[str]) -> list[str]:
    """``argv`` with each JSON object given to a mapping-valued field (e.g.
    ``--config.learner.loss_kwargs='{"dual_clip_c": null}'``) rewritten as the Python
    literal the flag library parses (``None``, ``True``), so JSON and Python forms
    both work. Other arguments, and values that are not JSON objects, are unchanged."""
    located = _config_file(argv)
    if located is None:
        return argv
    try:
        config = _load_config(*located)
    except Exception:  # the flag parser reports a broken config file itself
        return argv
    out = []
    for arg in argv:
        key, sep, value = arg[len("--config.") :].partition("=")
        if arg.startswith("--config.") and sep and _is_mapping_field(config, key):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = None  # not JSON: the flag library parses it (Python literal)
            if isinstance(parsed, dict):
                arg = f"--config.{key}={parsed!r}"
        out.append(arg)
    return out


def _is_mapping_field(config: Any, key: str) -> bool:
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node.keys():
            return False
        node = node[part]
    return hasattr(node, "keys")


def leftover_message(leftover: Sequence[str]) -> str | None:
    """The message for arguments the flag library did not take as flags, or None.

    absl hands back what is not a ``--flag`` (``config.total_steps=1``, a word after
    ``--``) instead of refusing it, and the run went on without it: refused here,
    with the flag it most likely meant.

    Args:
      leftover: the command line's non-flag arguments (the program name excluded).
    """
    if not leftover:
        return None
    first = leftover[0].lstrip("-")
    hint = f"--{first}" if "=" in first else "--config.<key>=<value>"
    return (
        f"unrecognised argument {leftover[0]!r}"
        + (f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else "")
        + f": settings are flags, e.g. {hint}"
    )


def parse_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """``absl.app.run``'s flags parser: a bad flag exits with status 2 and one line.

    Args:
      argv: the command line (``sys.argv``).
      flag_values: the flags to parse into (absl's global ones).

    Returns:
      ``[argv[0]]``: every other argument is a flag.

    Raises:
      SystemExit(2): a flag could not be parsed, or an argument is not a flag (the
        line says which and why).
    """
    located = _config_file(argv)
    if located is not None and not os.path.isfile(located[0]):
        print(f"config error: --config {located[0]}: no such file", file=sys.stderr)
        sys.exit(2)
    try:
        rest = flag_values(json_mappings(argv))
    except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as err:
        message = unknown_override(argv)
        if message is None:
            text = " ".join(str(err).split()) or type(err).__name__
            message = f"bad command line: {text}"
        print(f"config error: {message}", file=sys.stderr)
        sys.exit(2)
    message = leftover_message(rest[1:])
    if message is not None:
        print(f"config error: {message}", file=sys.stderr)
        sys.exit(2)
    return rest
