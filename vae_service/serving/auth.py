"""Optional bearer-token authentication of the HTTP routes and gRPC methods (handles are calls
inside the cluster and need none). The token comes from `auth_token_file` (config or
`--auth-token-file`) or the VAE_SERVICE_AUTH_TOKEN environment variable; it is compared in
constant time, and a missing token gets the same answer as a wrong one."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from vae_service.protocol.errors import Unauthenticated

TOKEN_ENV = "VAE_SERVICE_AUTH_TOKEN"


def load_token(token_file: str | None) -> str | None:
    if token_file:
        token = Path(token_file).expanduser().read_text().strip()
        if not token:
            raise ValueError(f"auth_token_file: {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


class BearerAuth:
    def __init__(self, token: str | None):
        self._expected = f"Bearer {token}".encode() if token else None

    @property
    def required(self) -> bool:
        return self._expected is not None

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless `authorization` is the expected `Bearer <token>`."""
        if self._expected is None:
            return
        given = (authorization or "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise Unauthenticated("Authorization", "a valid bearer token is required ('Authorization: Bearer ...')")

    def check_grpc(self, grpc_context) -> None:
        metadata = dict(grpc_context.invocation_metadata() or ())
        self.check(metadata.get("authorization"))
