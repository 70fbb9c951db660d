"""What limits a replica, as the floats Serve's custom autoscaling policy reads back
(serving/autoscaling_policy.py). Written by the autoscaling work: a placeholder until then."""

from __future__ import annotations


def load_report(service) -> dict[str, float]:
    sessions = service.sessions
    return {"sessions_open": float(len(sessions.open_sessions))}
