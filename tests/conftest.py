import os
import signal

import torch

# Triton kernels run in interpreter mode on machines without CUDA; it must be set before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.models import build_full_vae, load_reference, save_vae
from tests.s3 import s3_server  # noqa: F401 (a fixture: moto's S3 server, one per session)

# Tests stop the services they start with Ctrl-C. A suite launched as a background job (`cmd &` in
# a script) has SIGINT ignored, and every process it starts would inherit that and never stop.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest-xdist workers share the cores: torch's own threads split among them, so the totals do not
# oversubscribe the machine (most tests decode with one thread anyway, as the service's replicas do)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def kl_vae():
    return build_full_vae("kl")


@pytest.fixture(scope="session")
def flux_vae():
    return build_full_vae("flux")


@pytest.fixture(scope="session")
def wan_vae():
    return build_full_vae("wan")


@pytest.fixture(scope="session")
def kl_dir(kl_vae, tmp_path_factory):
    return save_vae(kl_vae, tmp_path_factory.mktemp("kl"))


@pytest.fixture(scope="session")
def flux_dir(flux_vae, tmp_path_factory):
    return save_vae(flux_vae, tmp_path_factory.mktemp("flux"))


@pytest.fixture(scope="session")
def wan_dir(wan_vae, tmp_path_factory):
    return save_vae(wan_vae, tmp_path_factory.mktemp("wan"))


# diffusers' own loads of the saved folders: the references for whatever loaded those folders (a
# service, an engine), never the in-memory models above (tests/models.py: load_reference says why)
@pytest.fixture(scope="session")
def kl_reference(kl_dir):
    return load_reference(kl_dir)


@pytest.fixture(scope="session")
def flux_reference(flux_dir):
    return load_reference(flux_dir)


@pytest.fixture(scope="session")
def wan_reference(wan_dir):
    return load_reference(wan_dir)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def wide_kl_vae():
    """64-channel decoder: wide enough for the CPU Winograd path."""
    return build_full_vae("kl64")
