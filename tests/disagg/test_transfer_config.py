"""--kv-transfer-config / --ec-transfer-config: vLLM's roles and connectors, and a clear refusal of anything else
(issue 29)."""

import json

import pytest
from serving_helpers import run_serve

from deepseek_v41.disagg.config import ECTransferConfig, KVTransferConfig

SHARED = {"shared_storage_path": "/tmp/x"}


def test_roles():
    producer = KVTransferConfig.from_cli(json.dumps({"kv_connector": "SharedStorageConnector",
                                                     "kv_role": "kv_producer", "kv_connector_extra_config": SHARED}))
    assert producer.is_producer and not producer.is_consumer and producer.prefill_only and producer.encoder_only
    both = KVTransferConfig("RedisConnector", "kv_both", {"url": "redis://127.0.0.1:6379/0"})
    assert both.is_producer and both.is_consumer and not both.prefill_only and not both.encoder_only
    full = KVTransferConfig("SharedStorageConnector", "kv_producer", {**SHARED, "encoder_only": False})
    assert not full.encoder_only
    encode = ECTransferConfig.from_cli({"ec_connector": "SharedStorageConnector", "ec_role": "ec_producer",
                                        "ec_connector_extra_config": SHARED})
    assert encode.encode_only and encode.is_producer and not encode.is_consumer


@pytest.mark.parametrize("value, message", [
    ("{not json", "must be a JSON object such as '{\"kv_connector\""),
    ("[1]", "must be a JSON object, got list"),
    ('{"kv_role": "kv_producer"}', "needs kv_connector"),
    ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"}', "is not one of SharedStorageConnector"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "producer"}', "kv_role 'producer' is not one of"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer"}', "needs shared_storage_path"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
     '{"shared_storage_path": 5}}', "shared_storage_path in kv_connector_extra_config must be a non-empty string"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
     '{"shared_storage_path": "/x", "bogus": 1}}', "does not take bogus"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
     '{"shared_storage_path": "/x", "encoder_only": true}}', "encoder_only applies to a kv_producer only"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
     '{"shared_storage_path": "/x", "encoder_only": "no"}}', "encoder_only must be true or false"),
    ('{"kv_connector": "RedisConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
     '{"url": "http://x"}}', "must start with redis://"),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer", "kv_buffer_size": 1}', "unknown keys"),
])
def test_bad_kv_transfer_configs_are_refused_clearly(value, message):
    with pytest.raises(ValueError, match=None) as info:
        KVTransferConfig.from_cli(value)
    assert message in str(info.value)


@pytest.mark.parametrize("value, message", [
    ("{", "--ec-transfer-config must be a JSON object such as '{\"ec_connector\""),
    ('{"ec_connector": "SharedStorageConnector", "ec_role": "kv_producer"}', "ec_role 'kv_producer' is not one of"),
    ('{"ec_connector": "SharedStorageConnector", "ec_role": "ec_consumer"}', "needs shared_storage_path"),
])
def test_bad_ec_transfer_configs_are_refused_clearly(value, message):
    with pytest.raises(ValueError) as info:
        ECTransferConfig.from_cli(value)
    assert message in str(info.value)


def test_serve_exits_2_naming_the_flag(tmp_path):
    result = run_serve(str(tmp_path), "--kv-transfer-config", '{"kv_connector": "Nope", "kv_role": "kv_producer"}')
    assert result.exit_code == 2 and "kv_connector 'Nope' is not one of" in result.output, result.output
    result = run_serve(str(tmp_path), "--ec-transfer-config", "[]")
    assert result.exit_code == 2 and "--ec-transfer-config must be a JSON object" in result.output, result.output
