"""Regenerate grpc_gen/decode_pb2*.py from decode.proto, with package-relative imports so the
modules import the same way in the Serve proxy, every replica and clients."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main() -> None:
    from grpc_tools import protoc

    here = Path(__file__).resolve().parent
    out = here / "grpc_gen"
    out.mkdir(exist_ok=True)
    args = ["protoc", f"-I{here}", f"--python_out={out}", f"--grpc_python_out={out}", str(here / "decode.proto")]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    # messages must carry their importable module name, or Ray cannot pickle them between actors
    messages = out / "decode_pb2.py"
    messages.write_text(messages.read_text().replace("'decode_pb2'", "'vae_service.protocol.grpc_gen.decode_pb2'"))
    grpc_module = out / "decode_pb2_grpc.py"
    text = re.sub(r"^import decode_pb2 as", "from . import decode_pb2 as", grpc_module.read_text(), flags=re.M)
    grpc_module.write_text(text)
    (out / "__init__.py").write_text('"""Generated from ../decode.proto by gen_grpc.py; do not edit."""\n')


if __name__ == "__main__":
    main()
