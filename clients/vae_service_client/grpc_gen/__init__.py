"""Generated from decode.proto by clients/gen_grpc.py; do not edit."""
