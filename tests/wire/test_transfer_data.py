"""The seed's ``KVCacheTransferData``: its dict, its device encoder and decoders and their
aliases."""

from __future__ import annotations

import pytest
import torch
from kv_payloads import assert_same, sample

from omnikv.wire.decode import decode_device
from omnikv.wire.transfer_data import KVCacheTransferData


def test_device_decoder_on_host_tensor_and_aliases() -> None:
    data = sample()
    t = torch.frombuffer(bytearray(data.to_bytes()), dtype=torch.uint8)
    out = KVCacheTransferData.from_bytes_device(t)
    assert_same(data, out)
    k0 = out["layer_blocks"]["key_cache"][0]
    assert not (t.data_ptr() <= k0.data_ptr() < t.data_ptr() + t.numel())  # copies
    assert_same(data, KVCacheTransferData.from_bytes_gpu(t))
    views = decode_device(t, copy=False)
    assert t.data_ptr() <= views["layer_blocks"]["key_cache"][0].data_ptr()


def test_to_gpu_tensor_without_device_tensors() -> None:
    with pytest.raises(RuntimeError, match="No device tensors"):
        sample().to_gpu_tensor()


def test_to_dict_keeps_tensors() -> None:
    data = sample()
    d = data.to_dict()
    assert d["layer_blocks"]["key_cache"][0] is data.layer_blocks["key_cache"][0]
    assert d["request_id"] == "req-1" and d["metadata"] == {"seq_len": 5}
