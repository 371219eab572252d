"""Messages between the controller and generation programs: JSON headers + raw arrays.

No pickle crosses a process boundary. A message is one byte string::

    b"JFR1" | uint32 big-endian header length | UTF-8 JSON header | payload

The header is a JSON object; ``header["arrays"]`` lists the arrays packed in the
payload (name, dtype, shape, byte offset), each C-ordered. The same bytes travel
as gRPC messages (``grpc`` with identity serializers: no generated code, no
protobuf schema to keep in step) and over the learner's command sockets.

What travels: ``GenerationRequest`` (controller -> generation program),
``Sample`` (back), ``WeightOffer`` (where a generation program pulls a policy
version from), and small JSON replies with a ``Status`` value: callers branch
on that enum, never on message text.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxflash.types import FinishReason, GenerationRequest, Sample, SamplingParams

_MAGIC = b"JFR1"
_DTYPES = ("int16", "int32", "int64", "float32", "float64", "uint8", "uint32", "bool", "bfloat16")

SERVICE = "jaxflash.GenerationProgram"
"""gRPC service name of a generation program (methods in ``METHODS``)."""

METHODS = ("Configure", "Update", "Submit", "Abort", "Stats", "Shutdown")
"""Unary methods; ``Events`` is the one server-streaming method."""

GRPC_OPTIONS = (
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
)


class Status(enum.StrEnum):
    """Outcome of a call to a generation program, carried in every reply's ``status``."""

    OK = "ok"
    REJECTED = "rejected"  # this request cannot run (too long, duplicate): the server is fine
    DOWN = "down"  # the program's generation loop failed, or it is not configured yet
    BAD_CONFIG = "bad_config"  # a Configure that differs from the one it runs with


class WireError(ValueError):
    """A malformed message (names what is wrong)."""


def encode(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One message from a JSON-able header and named numpy arrays.

    Raises:
      WireError: an array of an unsupported dtype, or a header key "arrays".
    """
    if "arrays" in header:
        raise WireError("header key 'arrays' is reserved for the payload index")
    index, parts, offset = [], [], 0
    for name, value in (arrays or {}).items():
        a = np.ascontiguousarray(value)
        dtype = a.dtype.name
        if dtype not in _DTYPES:
            raise WireError(f"array {name!r}: dtype {dtype} not in {_DTYPES}")
        raw = a.reshape(-1).view(np.uint8).tobytes()
        index.append({"name": name, "dtype": dtype, "shape": list(a.shape), "offset": offset})
        parts.append(raw)
        offset += len(raw)
    body = json.dumps({**header, "arrays": index}, separators=(",", ":")).encode()
    return b"".join([_MAGIC, struct.pack(">I", len(body)), body, *parts])


def decode(message: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(header, arrays) of one message; arrays are fresh, writable copies.

    Raises:
      WireError: bad magic, a truncated message, or an array that does not fit.
    """
    if len(message) < 8 or message[:4] != _MAGIC:
        raise WireError(f"not a jaxflash message (starts {bytes(message[:4])!r})")
    (size,) = struct.unpack(">I", message[4:8])
    if 8 + size > len(message):
        raise WireError(f"header of {size} bytes but the message has {len(message) - 8}")
    try:
        header = json.loads(message[8 : 8 + size])
    except ValueError as err:
        raise WireError(f"header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise WireError(f"header is a {type(header).__name__}, not an object")
    payload = memoryview(message)[8 + size :]
    arrays = {}
    for entry in header.pop("arrays", []):
        dtype = _dtype(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        start = int(entry["offset"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if start + nbytes > len(payload):
            raise WireError(f"array {entry['name']!r} runs past the end of the message")
        raw = np.frombuffer(payload[start : start + nbytes], np.uint8).copy()
        arrays[str(entry["name"])] = raw.view(dtype).reshape(shape)
    return header, arrays


def _dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise WireError(f"dtype {name!r} not in {_DTYPES}")
    if name == "bfloat16":
        import ml_dtypes  # noqa: PLC0415  (only when a bfloat16 array travels)

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ----------------------------------------------------------------- the messages


@dataclasses.dataclass(frozen=True)
class WeightOffer:
    """Where a generation program pulls policy version ``version`` from.

    Attributes:
      version: the policy version on offer.
      senders: control addresses ("host:port") of every learner process's
        ``WeightSender`` (one per process of the learner program), in process order.
    """

    version: int
    senders: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"version": int(self.version), "senders": list(self.senders)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WeightOffer:
        return cls(version=int(d["version"]), senders=tuple(str(s) for s in d["senders"]))


def encode_request(request: GenerationRequest) -> bytes:
    header = {
        "prompt_id": int(request.prompt_id),
        "sample_index": int(request.sample_index),
        "seed": int(request.seed),
        "sampling": dataclasses.asdict(request.sampling),
    }
    return encode(header, {"prompt_tokens": np.asarray(request.prompt_tokens, np.int32)})


def decode_request(message: bytes) -> GenerationRequest:
    """Raises: WireError (malformed), ValueError (bad sampling values)."""
    header, arrays = decode(message)
    try:
        return GenerationRequest(
            prompt_id=int(header["prompt_id"]),
            sample_index=int(header["sample_index"]),
            prompt_tokens=arrays["prompt_tokens"],
            sampling=SamplingParams(**header["sampling"]),
            seed=int(header["seed"]),
        )
    except (KeyError, TypeError) as err:
        raise WireError(f"not a generation request: {err!r}") from err


_SAMPLE_ARRAYS = ("prompt_tokens", "response_tokens", "behaviour_logprobs", "token_versions")
# Sent when set: a multi-turn sample's mask, a MoE engine's routes (int16 [T, L, k]).
_OPTIONAL_ARRAYS = ("response_mask", "routed_experts")


def sample_message(sample: Sample) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A finished sample as (header, arrays) (bit-exact: logprobs travel as raw float32,
    a MoE sample's routes as its int16 array)."""
    header = {
        "type": "sample",
        "prompt_id": int(sample.prompt_id),
        "sample_index": int(sample.sample_index),
        "start_version": int(sample.start_version),
        "finish_reason": str(sample.finish_reason),
    }
    arrays = {name: np.asarray(getattr(sample, name)) for name in _SAMPLE_ARRAYS}
    for name in _OPTIONAL_ARRAYS:
        if getattr(sample, name) is not None:
            arrays[name] = np.asarray(getattr(sample, name))
    return header, arrays


def sample_from_message(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Sample:
    """The inverse of ``sample_message``.

    Raises:
      WireError: a field or array missing.
    """
    try:
        return Sample(
            prompt_id=int(header["prompt_id"]),
            sample_index=int(header["sample_index"]),
            start_version=int(header["start_version"]),
            finish_reason=FinishReason(header["finish_reason"]),
            **{name: arrays.get(name) for name in _OPTIONAL_ARRAYS},
            **{name: arrays[name] for name in _SAMPLE_ARRAYS},
        )
    except (KeyError, ValueError) as err:
        raise WireError(f"not a sample: {err!r}") from err


def reply(status: Status, **fields: Any) -> bytes:
    """A small JSON reply carrying ``status``."""
    return encode({"status": status.value, **fields})


def reply_status(message: bytes) -> tuple[Status, dict[str, Any]]:
    """(status, the reply's other fields).

    Raises:
      WireError: no or an unknown status.
    """
    header, _ = decode(message)
    try:
        status = Status(header.pop("status"))
    except (KeyError, ValueError) as err:
        raise WireError(f"reply without a known status: {header}") from err
    return status, header
