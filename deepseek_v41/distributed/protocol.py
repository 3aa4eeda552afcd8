"""The control messages between the driver (rank 0) and its workers: JSON header + raw bytes, never pickle (issue 28).

A message is ``MAGIC``, the header's length (4 bytes, little endian), the header (UTF-8 JSON object) and the
concatenated raw blobs the header's ``"blobs"`` list sizes (bytes each). It travels as one
``multiprocessing.connection`` message (``send_bytes`` / ``recv_bytes`` only: the connection's ``send`` / ``recv``
would pickle, and a peer that can reach the port could then run code in the receiver).

Message types (``header["type"]``):

- ``hello`` (worker -> driver, first): ``rank``, ``pid``, ``host``.
- ``init`` (driver -> worker): ``model`` (path), ``dtype``, ``device``, ``engine_args`` (EngineArgs fields),
  ``parallel`` (:meth:`ParallelConfig.as_dict`), ``init_method`` (``tcp://HOST:PORT``), ``threads``.
- ``loaded`` / ``ready`` (worker -> driver): the weights are loaded; the engine is built (``rank``).
- ``step`` (driver -> worker): ``step`` (index), ``events`` (the add / abort / reset_prefix_cache calls since the
  previous step, in order), ``observation`` (rank 0's DSpark step-time measurement of the previous step or None),
  ``digest`` (:func:`outputs_digest` of rank 0's previous step outputs, or None).
- ``error`` (worker -> driver): ``rank``, ``message`` (the worker stops after sending it).
- ``shutdown`` (driver -> worker): leave the loop and exit 0.

Events (``header["events"][i]["op"]``): ``add`` (``request_id``, ``prompt_token_ids``, ``params``
(:func:`params_to_dict`), ``prompt``, ``arrival_time``, ``cache_salt``), ``abort`` (``request_id``),
``reset_prefix_cache`` (``reset_running_requests``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any

from deepseek_v41.engine.sampling_params import SamplingParams, StructuredOutputsParams

MAGIC = b"DSV4"
_LENGTH = struct.Struct("<I")


def encode(header: dict[str, Any], blobs: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    """One message of ``header`` (a JSON-able dict) and ``blobs`` (raw bytes, e.g. ``tensor.numpy().tobytes()``).
    Raises TypeError for a header JSON cannot encode."""
    header = {**header, "blobs": [len(b) for b in blobs]}
    text = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    return b"".join((MAGIC, _LENGTH.pack(len(text)), text, *blobs))


def decode(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """``(header, blobs)`` of a message made by :func:`encode`. Raises ValueError for bytes that are not one."""
    if data[:4] != MAGIC or len(data) < 8:
        raise ValueError("not a deepseek_v41 control message (bad magic)")
    (length,) = _LENGTH.unpack_from(data, 4)
    end = 8 + length
    try:
        header = json.loads(data[8:end])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"control message header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ValueError("control message header must be a JSON object with a 'type'")
    blobs, at = [], end
    for size in header.get("blobs", []):
        blobs.append(data[at: at + size])
        at += size
    if at != len(data):
        raise ValueError(f"control message has {len(data) - at} trailing bytes")
    return header, blobs


def send(conn: Any, header: dict[str, Any], blobs: list[bytes] | tuple[bytes, ...] = ()) -> None:
    """Send one message on a ``multiprocessing.connection.Connection`` (``send_bytes``)."""
    conn.send_bytes(encode(header, blobs))


def recv(conn: Any) -> tuple[dict[str, Any], list[bytes]]:
    """Receive one message (``recv_bytes``); EOFError when the peer closed the connection, ValueError for bytes
    that are not a message."""
    return decode(conn.recv_bytes())


# ---------------------------------------------------------------------------------------------- sampling params
def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """``params`` as a JSON-able dict (every field; ``structured_outputs`` as its own dict or None)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    so = params.structured_outputs
    out["structured_outputs"] = None if so is None else {f.name: getattr(so, f.name) for f in dataclasses.fields(so)}
    return out


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    """The :class:`SamplingParams` of :func:`params_to_dict` (validated again by its constructor: ValueError)."""
    data = dict(data)
    so = data.pop("structured_outputs", None)
    return SamplingParams(**data, structured_outputs=None if so is None else StructuredOutputsParams(**so))


# ---------------------------------------------------------------------------------------------- events
def add_event(request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
              arrival_time: float | None, cache_salt: str | None) -> dict[str, Any]:
    """The ``add`` event of one ``LLMEngine.add_request`` call (token-id prompts; images are not sent)."""
    return {"op": "add", "request_id": request_id, "prompt_token_ids": [int(t) for t in prompt_token_ids],
            "params": params_to_dict(params), "prompt": prompt, "arrival_time": arrival_time,
            "cache_salt": cache_salt}


def abort_event(request_id: str) -> dict[str, Any]:
    return {"op": "abort", "request_id": request_id}


def reset_event(reset_running_requests: bool) -> dict[str, Any]:
    return {"op": "reset_prefix_cache", "reset_running_requests": bool(reset_running_requests)}


def outputs_digest(outputs: list[Any]) -> str:
    """A short hash of one step's outputs (``RequestOutput`` list): per request (sorted by id) its id, and per
    sample the token ids it holds and whether it finished. Equal on every rank that made the same decisions."""
    h = hashlib.blake2b(digest_size=12)
    for out in sorted(outputs, key=lambda o: o.request_id):
        h.update(out.request_id.encode() + b"\0")
        for c in out.outputs:
            h.update(struct.pack("<iq?", c.index, len(c.token_ids), c.finish_reason is not None))
            h.update(struct.pack(f"<{len(c.token_ids)}q", *c.token_ids))
    return h.hexdigest()
