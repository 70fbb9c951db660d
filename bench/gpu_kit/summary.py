"""The GPU check's records and its JSON summary (stdlib only: it runs before anything is installed).

summary.py record --records R --name N --status S --rc RC --seconds T [--output F] [--note X]
    appends one step's record (the tail of its output F) to the JSON-lines file R;
summary.py write --records R --out OUT/summary.json --mode gpu|dry --python PY --budget B --elapsed E
    writes the summary: every step's record, the versions (torch, triton, CUDA, the GPU and its
    driver by nvidia-smi, the wheels' packages), the date and the git commit where there is one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TAIL_CHARS = 3000
STATUSES = ("passed", "failed", "timeout", "skipped")

# run by the check's own interpreter (with /tmp/site first): what the steps actually imported
PROBE = r"""
import importlib.metadata as md, json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        out.update(gpu_name=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   gpu_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   cudnn=torch.backends.cudnn.version())
except Exception as e:
    out["torch_error"] = repr(e)
packages = {}
for name in sys.argv[1:]:
    try:
        packages[name] = md.version(name)
    except md.PackageNotFoundError:
        packages[name] = None
out["packages"] = packages
print(json.dumps(out))
"""
PACKAGES = ["torch", "triton", "numpy", "diffusers", "pydantic", "pydantic-core", "av", "typing-extensions"]
PACKAGES += ["pytest", "pytest-asyncio", "huggingface-hub", "safetensors", "transformers", "msgpack", "pillow"]


def tail(path: str | None, chars: int = TAIL_CHARS) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - chars))
        return f.read().decode("utf-8", "replace")


def append_record(records: str, record: dict) -> None:
    assert record["status"] in STATUSES, record
    with open(records, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(records: str) -> list[dict]:
    if not os.path.exists(records):
        return []
    return [json.loads(line) for line in Path(records).read_text().splitlines() if line.strip()]


def _run(cmd: list[str], timeout: float = 30) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvidia_smi() -> dict | None:
    if not shutil.which("nvidia-smi"):
        return None
    query = "name,driver_version,memory.total,compute_cap"
    line = _run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"])
    info: dict = {"gpus": [dict(zip(query.split(","), (v.strip() for v in row.split(",")), strict=False))
                           for row in (line or "").splitlines()]}  # fmt: skip
    header = _run(["nvidia-smi"]) or ""
    for part in header.split("|"):
        if "CUDA Version" in part:
            info["cuda_driver_api"] = part.split("CUDA Version:")[-1].strip()
    return info


def git_commit() -> dict | None:
    if not shutil.which("git") or _run(["git", "rev-parse", "--is-inside-work-tree"]) != "true":
        return None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": _run(["git", "rev-parse", "HEAD"]), "modified_files": len((status or "").splitlines())}


def probe(python: list[str]) -> dict:
    try:
        done = subprocess.run(
            [*python, "-c", PROBE, *PACKAGES], capture_output=True, text=True, timeout=120, check=False
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except Exception as e:  # the summary is written whatever broke
        return {"probe_error": repr(e)}


def write(args: argparse.Namespace) -> int:
    steps = read_records(args.records)
    counts = {s: sum(r["status"] == s for r in steps) for s in STATUSES}
    summary = {
        "mode": args.mode,
        "ok": counts["failed"] == 0 and counts["timeout"] == 0 and bool(steps),
        "counts": counts,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": args.budget,
        "elapsed_s": args.elapsed,
        "git": git_commit(),
        "nvidia_smi": nvidia_smi(),
        "env": probe(args.python.split()),
        "steps": steps,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    width = max([len(r["name"]) for r in steps] + [4])
    print(f"\n== summary ({args.mode}): {args.out}")
    for r in steps:
        note = f"  {r['note']}" if r.get("note") else ""
        print(f"  {r['name']:<{width}}  {r['status']:<8} rc={r['rc']!s:<4} {r['seconds']:7.1f} s{note}")
    print(f"  {'ok' if summary['ok'] else 'NOT OK'}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--records", required=True)
    rec.add_argument("--name", required=True)
    rec.add_argument("--status", required=True, choices=STATUSES)
    rec.add_argument("--rc", type=int)
    rec.add_argument("--seconds", type=float, default=0.0)
    rec.add_argument("--output")
    rec.add_argument("--note", default="")
    out = sub.add_parser("write")
    out.add_argument("--records", required=True)
    out.add_argument("--out", required=True)
    out.add_argument("--mode", required=True, choices=["gpu", "dry"])
    out.add_argument("--python", default=sys.executable, help="the interpreter the steps ran (may hold options)")
    out.add_argument("--budget", type=float)
    out.add_argument("--elapsed", type=float)
    args = parser.parse_args(argv)
    if args.command == "record":
        record = {"name": args.name, "status": args.status, "rc": args.rc, "seconds": round(args.seconds, 1)}
        if args.note:
            record["note"] = args.note
        record["tail"] = tail(args.output)
        append_record(args.records, record)
        return 0
    return write(args)


if __name__ == "__main__":
    sys.exit(main())
