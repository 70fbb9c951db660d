"""A Serve autoscaling policy that a test drives: the deployment's replica count is the number in a
file (a scale-down or scale-up a test injects, with Serve draining the replicas it removes exactly as
it does for any policy's decision)."""

from __future__ import annotations

from pathlib import Path


class ReplicasFromFile:
    def __init__(self, path: str):
        self.path = Path(path)

    def __call__(self, context) -> tuple[int, dict]:
        try:
            return int(self.path.read_text()), {}
        except (OSError, ValueError):
            return context.current_num_replicas, {}
