"""Generated from ../decode.proto by gen_grpc.py; do not edit."""
