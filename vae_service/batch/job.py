"""Offline decode of whole datasets on Ray Data: inputs listed (a folder of latents files, or a
Parquet dataset with one latent per row), decoded by an actor pool of engines, files written
under the output folder, progress shown while it runs and a summary at the end. Finished inputs
are found by their files, so a rerun after an interruption decodes only the rest."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from vae_service.batch.latent_files import LATENT_SUFFIXES
from vae_service.batch.outputs import BATCH_OUTPUTS
from vae_service.batch.stage import DecodeStage
from vae_service.config import ServiceConfig
from vae_service.engine import QUALITIES

PARQUET_COLUMNS = ("name", "latents")


class BatchInputError(ValueError):
    """The job's input cannot be listed; raised before anything is decoded."""


def read_inputs(path: str | Path):
    """A Ray Dataset of inputs: rows {name, path} for a folder of .npy/.safetensors files (each
    file one request's latents, batch dimension first), or {name, latents} from Parquet (each
    row one latent item, no batch dimension; `name` names its output files)."""
    import ray.data

    path = Path(path)
    if path.is_file() and path.suffix == ".parquet":
        return _read_parquet(path, [path])
    if not path.is_dir():
        raise BatchInputError(f"{path}: not a folder of latents files nor a .parquet file")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in LATENT_SUFFIXES)
    if not files:
        parquet = sorted(path.rglob("*.parquet"))
        if parquet:
            return _read_parquet(path, parquet)
        raise BatchInputError(f"{path}: holds no {', '.join(LATENT_SUFFIXES)} or .parquet files")
    clashes = sorted(name for name, n in Counter(p.stem for p in files).items() if n > 1)
    if clashes:
        raise BatchInputError(f"{path}: several files would write the outputs of {clashes}; rename them")
    # a block per file: the pool's actors share the work evenly and progress moves file by file
    items = [{"name": p.stem, "path": str(p)} for p in files]
    return ray.data.from_items(items, override_num_blocks=len(items))


def _read_parquet(path: Path, files: list[Path]):
    import pyarrow.parquet as pq
    import ray.data

    columns = pq.read_schema(files[0]).names
    missing = [c for c in PARQUET_COLUMNS if c not in columns]
    if missing:
        raise BatchInputError(f"{files[0]}: needs columns {list(PARQUET_COLUMNS)}, lacks {missing}")
    return ray.data.read_parquet(str(path)).select_columns(list(PARQUET_COLUMNS))


def decode_dataset(
    ds,
    config: dict | ServiceConfig,
    output_dir: str | Path,
    *,
    quality: str = "lossless",
    output: str | None = None,
    concurrency: int = 1,
    num_gpus: float = 0,
    num_cpus: float = 1,
    batch_size: int = 1,
    options: dict | None = None,
):
    """Decode every row of `ds` ({name, path} or {name, latents} rows, as read_inputs makes them)
    into files under `output_dir`. Returns the lazy Dataset of per-input results (name, status:
    decoded | skipped | failed, files, error, decode_ms); consuming it runs the job. `options`
    are further /decode keys (scaling_factor, height, width, decode_timestep, ...)."""
    config = ServiceConfig.model_validate(config)
    if quality not in QUALITIES:
        raise ValueError(f"quality {quality!r}: one of {list(QUALITIES)}")
    if output is not None and output not in BATCH_OUTPUTS:
        raise ValueError(f"output {output!r}: one of {list(BATCH_OUTPUTS)}")
    from ray.data import ActorPoolStrategy

    return ds.map_batches(
        DecodeStage,
        fn_constructor_kwargs={
            "config": config.model_dump(),
            "output_dir": str(output_dir),
            "output": output,
            "quality": quality,
            "options": options,
        },
        batch_size=batch_size,
        batch_format="numpy",
        compute=ActorPoolStrategy(size=concurrency),
        num_cpus=num_cpus,
        num_gpus=num_gpus or None,
    )


@dataclass
class BatchSummary:
    total: int
    counts: Counter = field(default_factory=Counter)  # by status
    failures: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    seconds: float = 0.0

    @property
    def done(self) -> int:
        return sum(self.counts.values())

    @property
    def items_per_s(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def add(self, row: dict) -> None:
        self.counts[row["status"]] += 1
        if row["status"] == "failed":
            self.failures.append((row["name"], row["error"]))

    def progress_line(self) -> str:
        width = len(str(self.total))
        return (
            f"[{self.done:>{width}}/{self.total}] {self.counts['decoded']} decoded, {self.counts['skipped']} "
            f"skipped, {self.counts['failed']} failed, {self.items_per_s:.2f} items/s"
        )

    def report(self) -> str:
        lines = [
            f"{self.done} of {self.total} inputs in {self.seconds:.1f} s ({self.items_per_s:.2f} items/s): "
            f"{self.counts['decoded']} decoded, {self.counts['skipped']} skipped (already done), "
            f"{self.counts['failed']} failed"
        ]
        lines += [f"  failed {name}: {reason}" for name, reason in self.failures]
        return "\n".join(lines)


class Progress:
    """One line rewritten in place on a terminal; elsewhere (logs, CI) a line every few seconds."""

    def __init__(self, stream: TextIO, every_s: float = 5.0):
        self.stream, self.every_s = stream, every_s
        self.tty = stream.isatty()
        self.last = float("-inf")

    def show(self, summary: BatchSummary, final: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + summary.progress_line() + ("\n" if final else ""))
        elif final or now - self.last >= self.every_s:
            self.stream.write(summary.progress_line() + "\n")
        else:
            return
        self.last = now
        self.stream.flush()


def run_batch_decode(
    input_path: str | Path,
    output_dir: str | Path,
    config: dict | ServiceConfig,
    progress: TextIO | None = None,
    **options,
) -> BatchSummary:
    """read_inputs + decode_dataset, consumed here, with a progress display on `progress` (e.g.
    sys.stderr) while it runs; the summary at the end."""
    ds = read_inputs(input_path)
    summary = BatchSummary(total=ds.count())
    shown = Progress(progress) if progress is not None else None
    start = time.monotonic()
    for row in decode_dataset(ds, config, output_dir, **options).iter_rows():
        summary.add(row)
        summary.seconds = time.monotonic() - start
        if shown is not None:
            shown.show(summary)
    summary.seconds = time.monotonic() - start
    if shown is not None:
        shown.show(summary, final=True)
    return summary
