"""Probes of the long-range path (issue 5): indexer recall and the compressed entries' effect on loss."""

import numpy as np
import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.indexer_loss import indexer_recall as recall_of
from deepseek_v41.train.probes import indexer_recall, long_range_nats


def test_recall_arithmetic():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4]).view(1, 1, 1, 4)  # one query, one head, four entries
    recall, random, queries = recall_of(probs, torch.tensor([[[3, 2]]]), torch.tensor([[[0, 1, 2, 3]]]))
    assert (round(recall, 6), random, queries) == (0.7, 0.5, 1)
    # A query that sees no more entries than it selects is not counted.
    assert recall_of(probs, torch.tensor([[[0, 1, 2, 3]]]), torch.tensor([[[0, 1, 2, 3]]]))[2] == 0


def test_random_model_recall_is_near_random_and_entries_change_the_loss():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    stream = np.random.RandomState(0).randint(3, 512, 800)
    per_layer = indexer_recall(model, stream, context=128, windows=2)
    assert set(per_layer) == {2, 4, 6}
    for layer in per_layer.values():
        assert layer["queries"] > 0 and 0 < layer["recall"] < 1
        assert abs(layer["recall"] - layer["random"]) < 0.1  # an untrained indexer knows nothing
    nats = long_range_nats(model, stream, context=128, windows=2)
    assert nats["tokens"] == 2 * (128 - model.config.sliding_window)
    assert nats["with_entries"] != nats["window_only"]
