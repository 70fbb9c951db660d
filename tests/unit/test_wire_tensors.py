"""The wire's tensor maps (vae_service_client.tensors) and the server's zero-copy view of them."""

import numpy as np
import pytest
import torch

from vae_service.protocol.tensors import to_numpy, to_torch
from vae_service_client.tensors import LATENT_DTYPES, WireError, decode_tensor, encode_tensor


def round_trip(x):
    return to_torch(decode_tensor(encode_tensor(x), "t"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("shape", [(3,), (2, 4, 5, 7), (1, 16, 3, 5, 9)])
def test_torch_round_trip_is_bit_exact(dtype, shape):
    x = (torch.randn(shape) * 50).to(dtype)
    y = round_trip(x)
    assert y.dtype == dtype and y.shape == x.shape
    bits = torch.uint8 if dtype == torch.uint8 else torch.int16 if x.element_size() == 2 else torch.int32
    assert torch.equal(y.view(bits), x.view(bits))


def test_non_contiguous_tensor_is_sent_in_c_order():
    x = torch.randn(4, 6).t()
    assert torch.equal(round_trip(x), x)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, ">f4"])
def test_numpy_round_trip_in_any_byte_order(dtype):
    x = (np.random.default_rng(0).standard_normal((2, 3, 4)) * 9).astype(dtype)
    enc = encode_tensor(x)
    assert enc["dtype"] == np.dtype(dtype).newbyteorder("=").name
    np.testing.assert_array_equal(decode_tensor(enc, "t").to_numpy(), x)


def test_bf16_decodes_to_the_same_values_in_float32_without_torch():
    x = torch.randn(3, 5).to(torch.bfloat16)
    out = decode_tensor(encode_tensor(x), "t").to_numpy()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x.float().numpy())
    np.testing.assert_array_equal(to_numpy(x), x.float().numpy())


def test_server_view_aliases_the_request_bytes():
    data = encode_tensor(torch.arange(6, dtype=torch.float32))
    raw = bytes(data["data"])  # as msgpack hands a bin to the server
    t = to_torch(decode_tensor({**data, "data": raw}, "t"))
    assert t.data_ptr() == np.frombuffer(raw, np.uint8).ctypes.data  # no copy between body and tensor
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))


def test_unsupported_send_dtype():
    with pytest.raises(TypeError, match="int64"):
        encode_tensor(torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(
    "mutate, field, text",
    [
        (lambda m: m.update(dtype="float64"), "latents.dtype", "unknown dtype"),
        (lambda m: m.update(dtype="uint8"), "latents.dtype", "unknown dtype"),
        (lambda m: m.update(shape=[1, 4, 0, 2]), "latents.shape", "positive"),
        (lambda m: m.update(shape=[1, 4, -2, 2]), "latents.shape", "positive"),
        (lambda m: m.update(shape=[1, 4, 2.0, 2]), "latents.shape", "ints"),
        (lambda m: m.update(shape=[1, 4, True, 2]), "latents.shape", "ints"),
        (lambda m: m.update(shape=[]), "latents.shape", "list"),
        (lambda m: m.update(shape=[1] * 7), "latents.shape", "list"),
        (lambda m: m.update(shape="1x4"), "latents.shape", "list"),
        (lambda m: m.update(data=bytes(m["data"])[:-1]), "latents.data", "needs 64"),
        (lambda m: m.update(data="text"), "latents.data", "binary"),
        (lambda m: m.pop("data"), "latents", "exactly the keys"),
        (lambda m: m.update(extra=1), "latents", "exactly the keys"),
    ],
)
def test_bad_tensor_maps_name_the_field(mutate, field, text):
    m = encode_tensor(torch.zeros(1, 4, 2, 2))
    mutate(m)
    with pytest.raises(WireError, match=text) as err:
        decode_tensor(m, "latents", LATENT_DTYPES)
    assert err.value.field == field and err.value.message.startswith(field)


def test_non_map_tensor():
    with pytest.raises(WireError) as err:
        decode_tensor([1, 2], "latents")
    assert err.value.field == "latents"
