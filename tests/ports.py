"""Free local ports for the Ray clusters tests start (the integration suite's, the multi-node one)."""

import socket

# ports Ray's components take by default: an ephemeral port that lands on one fails ray.init
# ("metrics_export is trying to use a port number 52365 that is used by other components", seen in CI)
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365}


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port
