"""``--kv-transfer-config`` and ``--ec-transfer-config``: the roles of a disaggregated server, in vLLM's words.

Encode / prefill / decode disaggregation (issue 29; SPEC.md §4.3 for the page format the transfers reuse):

- ``kv_producer``: a **prefill server**. Every request it gets is prefill-only: the prompt's global KV pages (FP4
  main entries + FP4 index keys of the kv-source layers, and the open compressor pair) are computed and written to
  the connector, nothing is sampled, and the response carries ``kv_transfer_params``. With a CED layout it runs
  (and, unless ``"encoder_only": false``, loads) only what the global KV needs: the encoder layers and the first
  decoder layer's compressor / index-key path (MODEL_REFERENCE.md §3.16).
- ``kv_consumer``: a **decode server**. It reads the prompt's pages from the connector (a partial or corrupt
  transfer is a miss: every page is checksummed), rebuilds the window state by replaying at most one window
  (``--replay bounded``) or the encoder's receptive field (``--replay exact``), and decodes.
- ``kv_both``: both: a request whose ``kv_transfer_params`` say ``{"do_remote_decode": true}`` is prefill-only,
  any other is served whole, reading and writing the connector.

Connectors (``kv_connector``): ``SharedStorageConnector`` (the page store of the persistent prefix cache on a
shared directory, ``kv_connector_extra_config: {"shared_storage_path": DIR}``), ``RedisConnector``
(``{"url": "redis://..."}``; the Redis page tier) and ``NixlConnector`` (the optional ``nixl`` extra).

``--ec-transfer-config`` moves the vision encoder's output (aligner rows keyed by the image's content hash):
``ec_producer`` (an **encode server**: loads the vision tower and aligner only, encodes the images of each request
and writes their rows), ``ec_consumer`` (reads the rows of an image before encoding it itself), ``ec_both``.
Connector: ``SharedStorageConnector`` (``ec_connector_extra_config: {"shared_storage_path": DIR}``).

Source: vLLM ``vllm/config/kv_transfer.py`` (``KVTransferConfig``), ``vllm/config/ec_transfer.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KV_CONNECTORS = ("SharedStorageConnector", "RedisConnector", "NixlConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
EC_CONNECTORS = ("SharedStorageConnector",)
EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")
# What each connector needs in its extra config, and the keys it takes.
_KV_EXTRA = {
    "SharedStorageConnector": ({"shared_storage_path"}, {"shared_storage_path", "encoder_only", "max_bytes"}),
    "RedisConnector": ({"url"}, {"url", "encoder_only"}),
    "NixlConnector": (set(), {"encoder_only", "side_channel_host", "side_channel_port", "peers", "buffer_bytes",
                              "backends"}),
}
_EC_EXTRA = {"SharedStorageConnector": ({"shared_storage_path"}, {"shared_storage_path", "max_bytes"})}


def _parse(value: str | dict[str, Any], flag: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        key = "ec_connector" if flag.startswith("--ec") else "kv_connector"
        raise ValueError(f"{flag} must be a JSON object such as '{{\"{key}\": \"SharedStorageConnector\", "
                         f"...}}': {exc.msg} at character {exc.pos}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _check_extra(extra: Any, connector: str, table: dict, flag: str, key: str) -> dict[str, Any]:
    if not isinstance(extra, dict):
        raise ValueError(f"{flag}: {key} must be a JSON object, got {extra!r}")
    needed, allowed = table[connector]
    missing = sorted(needed - set(extra))
    if missing:
        raise ValueError(f"{flag}: {connector} needs {', '.join(missing)} in {key}")
    for name in ("shared_storage_path", "url"):
        if name in extra and (not isinstance(extra[name], str) or not extra[name]):
            raise ValueError(f"{flag}: {name} in {key} must be a non-empty string, got {extra[name]!r}")
    if "url" in extra and not extra["url"].startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{flag}: url {extra['url']!r} must start with redis://, rediss:// or unix://")
    if "max_bytes" in extra and (isinstance(extra["max_bytes"], bool) or not isinstance(extra["max_bytes"], int)
                                 or extra["max_bytes"] <= 0):
        raise ValueError(f"{flag}: max_bytes in {key} must be a positive integer, got {extra['max_bytes']!r}")
    unknown = sorted(set(extra) - allowed)
    if unknown:
        raise ValueError(f"{flag}: {connector} does not take {', '.join(unknown)} in {key}; it takes "
                         f"{', '.join(sorted(allowed))}")
    return extra


@dataclass(frozen=True)
class KVTransferConfig:
    """One server's KV transfer role (module docstring).

    ``kv_connector``: one of :data:`KV_CONNECTORS`. ``kv_role``: one of :data:`KV_ROLES`.
    ``kv_connector_extra_config``: the connector's settings (``shared_storage_path`` for SharedStorage, ``url`` for
    Redis; ``encoder_only`` (bool, default True) for a producer).
    Raises ValueError naming the field and the allowed values for anything else.
    """

    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flag = "--kv-transfer-config"
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"{flag}: kv_connector {self.kv_connector!r} is not one of {', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"{flag}: kv_role {self.kv_role!r} is not one of {', '.join(KV_ROLES)}")
        extra = _check_extra(self.kv_connector_extra_config, self.kv_connector, _KV_EXTRA, flag,
                             "kv_connector_extra_config")
        if not isinstance(extra.get("encoder_only", True), bool):
            raise ValueError(f"{flag}: encoder_only must be true or false, got {extra['encoder_only']!r}")
        if "encoder_only" in extra and self.kv_role != "kv_producer":
            raise ValueError(f"{flag}: encoder_only applies to a kv_producer only (this is a {self.kv_role})")

    @classmethod
    def from_cli(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        """Parse the flag's JSON (or a dict, as ``LLM(kv_transfer_config=...)`` takes it). Raises ValueError."""
        raw = _parse(value, "--kv-transfer-config")
        unknown = sorted(set(raw) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown keys {', '.join(unknown)}; it takes kv_connector, "
                             f"kv_role and kv_connector_extra_config")
        for key in ("kv_connector", "kv_role"):
            if key not in raw:
                raise ValueError(f"--kv-transfer-config needs {key}")
        return cls(raw["kv_connector"], raw["kv_role"], raw.get("kv_connector_extra_config") or {})

    @property
    def is_producer(self) -> bool:
        """Writes pages to the connector."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Reads pages from the connector."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def prefill_only(self) -> bool:
        """Every request is prefill-only (a kv_producer)."""
        return self.kv_role == "kv_producer"

    @property
    def encoder_only(self) -> bool:
        """A producer that loads and runs only what the global KV needs (default for a kv_producer)."""
        return self.prefill_only and bool(self.kv_connector_extra_config.get("encoder_only", True))

    def to_dict(self) -> dict[str, Any]:
        return {"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                "kv_connector_extra_config": dict(self.kv_connector_extra_config)}


@dataclass(frozen=True)
class ECTransferConfig:
    """One server's encoder-cache transfer role (module docstring): ``ec_connector`` (:data:`EC_CONNECTORS`),
    ``ec_role`` (:data:`EC_ROLES`), ``ec_connector_extra_config`` (``shared_storage_path``). Raises ValueError."""

    ec_connector: str
    ec_role: str
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        flag = "--ec-transfer-config"
        if self.ec_connector not in EC_CONNECTORS:
            raise ValueError(f"{flag}: ec_connector {self.ec_connector!r} is not one of {', '.join(EC_CONNECTORS)}")
        if self.ec_role not in EC_ROLES:
            raise ValueError(f"{flag}: ec_role {self.ec_role!r} is not one of {', '.join(EC_ROLES)}")
        _check_extra(self.ec_connector_extra_config, self.ec_connector, _EC_EXTRA, flag, "ec_connector_extra_config")

    @classmethod
    def from_cli(cls, value: str | dict[str, Any]) -> ECTransferConfig:
        """Parse the flag's JSON (or a dict). Raises ValueError."""
        raw = _parse(value, "--ec-transfer-config")
        unknown = sorted(set(raw) - {"ec_connector", "ec_role", "ec_connector_extra_config"})
        if unknown:
            raise ValueError(f"--ec-transfer-config: unknown keys {', '.join(unknown)}; it takes ec_connector, "
                             f"ec_role and ec_connector_extra_config")
        for key in ("ec_connector", "ec_role"):
            if key not in raw:
                raise ValueError(f"--ec-transfer-config needs {key}")
        return cls(raw["ec_connector"], raw["ec_role"], raw.get("ec_connector_extra_config") or {})

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    def to_dict(self) -> dict[str, Any]:
        return {"ec_connector": self.ec_connector, "ec_role": self.ec_role,
                "ec_connector_extra_config": dict(self.ec_connector_extra_config)}

    @property
    def encode_only(self) -> bool:
        """An encode server (``ec_producer``): the vision tower and aligner only, no language model."""
        return self.ec_role == "ec_producer"
