import numpy as np
import pytest
import torch

from vae_service.errors import RequestError
from vae_service.protocol.tensor_codec import decode_tensor, encode_tensor, require_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("shape", [(3,), (2, 4, 5, 7), (1, 16, 3, 5, 9)])
def test_torch_round_trip_is_exact(dtype, shape):
    x = (torch.randn(shape) * 50).to(dtype)
    y = decode_tensor(encode_tensor(x), "t")
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(torch.uint8) if dtype != torch.uint8 else y, x.view(torch.uint8) if dtype != torch.uint8 else x)


def test_non_contiguous_tensor_is_sent_in_c_order():
    x = torch.randn(4, 6).t()
    assert torch.equal(decode_tensor(encode_tensor(x), "t"), x)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8])
def test_numpy_round_trip(dtype):
    x = (np.random.default_rng(0).standard_normal((2, 3, 4)) * 9).astype(dtype)
    enc = encode_tensor(x)
    assert enc["dtype"] == np.dtype(dtype).name
    np.testing.assert_array_equal(decode_tensor(enc, "t").numpy(), x)


def test_decoded_tensor_owns_writable_memory():
    data = encode_tensor(torch.ones(4))
    y = decode_tensor(data, "t")
    y += 1  # would raise or corrupt the request buffer if it aliased immutable bytes
    assert torch.equal(y, torch.full((4,), 2.0))


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
        (lambda m: m.update(shape="1x4"), "latents.shape", "list"),
        (lambda m: m.update(data=m["data"][:-1]), "latents.data", "needs 64"),
        (lambda m: m.update(data="text"), "latents.data", "binary"),
        (lambda m: m.pop("data"), "latents", "exactly the keys"),
        (lambda m: m.update(extra=1), "latents", "exactly the keys"),
    ],
)
def test_bad_tensor_maps_name_the_field(mutate, field, text):
    m = encode_tensor(torch.zeros(1, 4, 2, 2))
    mutate(m)
    with pytest.raises(RequestError, match=text) as err:
        decode_tensor(m, "latents", ("float32", "float16", "bfloat16"))
    assert err.value.field == field and err.value.status == 400


def test_non_map_tensor():
    with pytest.raises(RequestError) as err:
        decode_tensor([1, 2], "latents")
    assert err.value.field == "latents"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused(bad):
    x = torch.zeros(2, 3)
    x[1, 2] = bad
    with pytest.raises(RequestError, match="1 NaN or Inf") as err:
        require_finite(x, "latents")
    assert err.value.field == "latents"
