"""The client distribution alone: installed into a fresh venv with nothing else, by the README's
own command for denoiser workers, it imports without torch, ray, diffusers or pydantic, decodes
against the running service over HTTP and gRPC, and runs the README's first decode as written.
What a denoiser worker that only posts latents installs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models import reference_decode, torch_threads

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
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
    try:  # the extra the README names for it: without Pillow, a hint instead of "No module named 'PIL'"
        client.decode(z[:1], output="png").images()
    except ImportError as exc:
        no_pillow = str(exc)
with VaeGrpcClient(grpc_target, application="kl") as client:
    grpc = client.decode(z, output="float", scaling_factor=None)
    try:
        client.decode(z[:, :3])
    except InvalidRequest as exc:
        grpc_error = str(exc)
np.savez(out_path, http=http.output, grpc=grpc.output)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {set(SERVER_ONLY)})
print(json.dumps({{"loaded": loaded, "model": http.model, "request_id": http.request_id, "error": error,
                   "no_pillow": no_pillow, "grpc_error": grpc_error.split(":")[0]}}))
"""


def readme_install_command() -> str:
    """The install the README names for denoiser workers, exactly as it is written there."""
    (command,) = re.findall(r"Denoiser workers need only\s+the client:\s+`([^`]+)`", README)
    return command


@pytest.fixture(scope="module")
def client_python(tmp_path_factory):
    """A fresh venv, then the README's command run as written in the checkout, with the venv on PATH
    (an activated venv's `pip`)."""
    venv = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    command = readme_install_command()
    assert command == "pip install ./clients"
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    install = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-2000:]
    return venv / "bin" / "python"


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
    assert report == {
        "loaded": [], "model": "kl", "request_id": "alone", "error": [400, "latents"],
        "no_pillow": 'images() needs Pillow: pip install "./clients[images]" (or pillow); the encoded files are '
                     "in `output` as bytes without it",
        "grpc_error": "gRPC INVALID_ARGUMENT invalid_request",  # its gRPC status, not "HTTP 400"
    }  # fmt: skip
    with torch_threads(1):
        expected = reference_decode(kl_reference, torch.from_numpy(z)).numpy()
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(out["http"], expected)
    np.testing.assert_array_equal(out["grpc"], expected)


def test_the_readmes_first_decode_runs_as_written_on_the_client_only_install(client_python, kl_url, tmp_path):
    """Before: `answer.images()` raised "No module named 'PIL'" after the decode had run."""
    snippet = re.search(r"## A first decode.*?```python\n(.*?)```", README, re.S)[1]
    code = snippet.replace("http://127.0.0.1:8000", kl_url)
    assert code != snippet  # the README's URL, pointed at this test's service
    run = subprocess.run([str(client_python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    png = (tmp_path / "out.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[16:24] == (256).to_bytes(4, "big") * 2  # 256 x 256
