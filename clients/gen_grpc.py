"""Regenerate vae_service_client/grpc_gen/decode_pb2*.py from decode.proto (needs grpcio-tools at
or below the installed grpcio): `python clients/gen_grpc.py`.

The modules get package-relative imports and their importable module name, so they load the same
way in Serve's proxy, every replica and clients, and Ray can pickle the messages between actors.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main() -> None:
    from grpc_tools import protoc

    out = Path(__file__).resolve().parent / "vae_service_client" / "grpc_gen"
    args = ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", str(out / "decode.proto")]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    messages = out / "decode_pb2.py"
    messages.write_text(messages.read_text().replace("'decode_pb2'", "'vae_service_client.grpc_gen.decode_pb2'"))
    grpc_module = out / "decode_pb2_grpc.py"
    grpc_module.write_text(
        re.sub(r"^import decode_pb2 as", "from . import decode_pb2 as", grpc_module.read_text(), flags=re.M)
    )
    (out / "__init__.py").write_text('"""Generated from decode.proto by clients/gen_grpc.py; do not edit."""\n')


if __name__ == "__main__":
    main()
