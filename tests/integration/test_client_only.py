"""The client distribution alone: installed into a fresh venv with nothing else, it imports
without torch, ray, diffusers or pydantic, and decodes against the running service over HTTP and
gRPC. What a denoiser worker that only posts latents installs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models import reference_decode, torch_threads

pytestmark = pytest.mark.integration
CLIENTS = Path(__file__).resolve().parents[2] / "clients"
SERVER_ONLY = ("torch", "ray", "diffusers", "pydantic", "triton", "fastapi", "vae_service")

SCRIPT = f"""
import json, sys
import numpy as np
from vae_service_client import VaeClient, VaeGrpcClient, InvalidRequest

url, grpc_target, latents_path, out_path = sys.argv[1:5]
z = np.load(latents_path)
with VaeClient(url) as client:
    http = client.decode(z, output="float", scaling_factor=None, request_id="alone")
    try:
        client.decode(z[:, :3])
        error = None
    except InvalidRequest as exc:
        error = [exc.status, exc.field]
with VaeGrpcClient(grpc_target, application="kl") as client:
    grpc = client.decode(z, output="float", scaling_factor=None)
np.savez(out_path, http=http.output, grpc=grpc.output)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {set(SERVER_ONLY)})
print(json.dumps({{"loaded": loaded, "model": http.model, "request_id": http.request_id, "error": error}}))
"""


@pytest.fixture(scope="module")
def client_python(tmp_path_factory):
    venv = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(CLIENTS)], capture_output=True, text=True, timeout=900
    )
    assert install.returncode == 0, install.stderr[-2000:]
    return python


def test_the_client_distribution_installs_and_decodes_alone(client_python, kl_url, grpc_target, kl_reference, tmp_path):
    installed = subprocess.run(
        [str(client_python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "vae-service-client" in names and not names & {"torch", "ray", "diffusers", "pydantic", "triton"}

    z = np.random.default_rng(8).standard_normal((2, 4, 3, 5)).astype(np.float32)
    np.save(tmp_path / "z.npy", z)
    run = subprocess.run(
        [str(client_python), "-c", SCRIPT, kl_url, grpc_target, str(tmp_path / "z.npy"), str(tmp_path / "out.npz")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report == {"loaded": [], "model": "kl", "request_id": "alone", "error": [400, "latents"]}
    with torch_threads(1):
        expected = reference_decode(kl_reference, torch.from_numpy(z)).numpy()
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(out["http"], expected)
    np.testing.assert_array_equal(out["grpc"], expected)
