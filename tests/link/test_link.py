"""``link/link.py``'s shared state of the link ends: AQ-SGD's sample-id queue hands the encode its inputs."""

import types

import pytest
import torch

from megatron_tah.link.link import SampleIds

PLAIN, AQSGD = types.SimpleNamespace(needs_sample_ids=False), types.SimpleNamespace(needs_sample_ids=True)


def test_every_activation_send_takes_the_oldest_ids_and_only_a_codec_that_needs_them_gets_them():
    ids = SampleIds()
    for first in (0, 2, 4):
        ids.push(torch.arange(first, first + 2))
    assert ids.encode_inputs("forward", PLAIN) == {} and len(ids) == 2  # taken all the same: the queue stays bounded
    assert torch.equal(ids.encode_inputs("forward", AQSGD)["sample_ids"], torch.tensor([2, 3]))
    assert ids.encode_inputs("backward", PLAIN) == {} and len(ids) == 1  # gradients carry none
    assert ids.encode_inputs("backward", AQSGD) == {"sample_ids": None}  # (the codec refuses it)


def test_a_codec_that_needs_ids_and_finds_none_queued_is_an_error():
    with pytest.raises(RuntimeError, match="push_sample_ids"):
        SampleIds().encode_inputs("forward", AQSGD)
    assert SampleIds().encode_inputs("forward", PLAIN) == {}
