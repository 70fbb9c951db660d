"""Offline decode of whole datasets on Ray Data: inputs listed (a folder of latents files, or a
Parquet dataset with one latent per row; local, or in object storage: s3://bucket/prefix, gs://...,
through vae_service/storage) with every output path computed before anything is
decoded (two inputs that would write one file are refused, naming both), decoded by an actor pool
of engines, files written under the output folder, progress shown while it runs and a summary at
the end. Finished inputs are found by their files, so a rerun after an interruption decodes only
the rest; a store that fails for several inputs in a row stops the job (its engines try no more),
and the rerun resumes it, first removing the temporaries the interrupted writes left behind."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from vae_service.batch.latent_files import LATENT_SUFFIXES, LatentFileError, latents_shape
from vae_service.batch.outputs import BATCH_OUTPUTS, OutputFolder
from vae_service.batch.stage import BATCH_PRIORITY, STOP_AFTER_STORE_FAILURES, DecodeStage
from vae_service.config import ServiceConfig
from vae_service.engine import QUALITIES
from vae_service.names import PRIORITIES
from vae_service.storage import Location, LocationError, StoreUnavailable, open_location, scrub

PARQUET_COLUMNS = ("name", "latents")
REPORTED_FAILURES = 20  # a summary names this many failures; a store that died can fail thousands


class BatchInputError(ValueError):
    """The job's input cannot be listed, or two inputs would write one file; raised before
    anything is decoded."""


@dataclass(frozen=True)
class Inputs:
    """A job's inputs, listed without Ray: a folder's latents files (`files`) or Parquet files
    (`parquet`, under `root`), with the number of latent items of each input (`items`); local or
    in a store (storage Locations)."""

    root: Location
    files: tuple[Location, ...] = ()
    parquet: tuple[Location, ...] = ()
    items: dict[str, int] = field(default_factory=dict)  # input name -> latent items

    @property
    def count(self) -> int:
        return len(self.items)

    @property
    def total_items(self) -> int:
        return sum(self.items.values())

    def output_names(self, output: str | None = None) -> set[str]:
        """The names of every file the job writes."""
        return {out for _, out in _planned(self.root, self.items, output)}

    def dataset(self):
        """A Ray Dataset of rows {name, path} (a folder) or {name, latents} (Parquet)."""
        import ray.data

        if self.parquet:
            parquet = ray.data.read_parquet(self.root.path, filesystem=self.root.fs)
            return parquet.select_columns(list(PARQUET_COLUMNS))
        # a block per file: the pool's actors share the work evenly and progress moves file by file;
        # `path` a local path or a URI with its store's options (no credentials: workers read theirs)
        rows = [{"name": p.stem, "path": p.spec} for p in self.files]
        return ray.data.from_items(rows, override_num_blocks=len(rows))


def list_inputs(path: str | Path | Location, output: str | None = None) -> Inputs:
    """The inputs under `path` (a local path, a URI such as s3://bucket/prefix?endpoint_override=...,
    or a Location), every output path computed (`output`: the output kind, unset for the default;
    the names are the same for png, jpeg and mp4). Raises BatchInputError, also for a location
    that cannot be read."""
    try:
        return _list_inputs(path if isinstance(path, Location) else open_location(str(path)), output)
    except (LocationError, StoreUnavailable) as exc:
        raise BatchInputError(scrub(exc)) from None


def _list_inputs(path: Location, output: str | None) -> Inputs:
    if path.suffix == ".parquet" and path.is_file():
        return _parquet_inputs(path, [path], output)
    if not path.is_dir():
        raise BatchInputError(f"{path}: not a folder of latents files nor a .parquet file")
    files = [p for p in path.files() if p.suffix in LATENT_SUFFIXES]
    if not files:
        parquet = [p for p in path.files(recursive=True) if p.suffix == ".parquet"]
        if parquet:
            return _parquet_inputs(path, parquet, output)
        raise BatchInputError(f"{path}: holds no {', '.join(LATENT_SUFFIXES)} or .parquet files")
    names = [p.stem for p in files]
    if len(set(names)) != len(names):  # x.npy and x.safetensors: one name for two inputs
        twice = next(n for n in names if names.count(n) > 1)
        both = [p.name for p in files if p.stem == twice]
        raise BatchInputError(f"{path}: {both[0]} and {both[1]} are both input {twice!r}: rename one")
    items = {p.stem: _items_of(p) for p in files}
    _refuse_clashes(path, {p.stem: p.name for p in files}, items, output)
    return Inputs(path, files=tuple(files), items=items)


def _items_of(path: Location) -> int:
    """Its latents' batch dimension from the file's header; an unreadable file fails when it is
    decoded (and writes nothing): one item here."""
    try:
        shape = latents_shape(path)
    except LatentFileError:
        return 1
    return shape[0] if shape else 1


def _parquet_inputs(root: Location, files: list[Location], output: str | None) -> Inputs:
    import pyarrow as pa

    try:
        return _read_parquet_inputs(root, files, output)
    except (OSError, pa.ArrowException) as exc:  # pyarrow's own text may name the endpoint: scrubbed
        raise BatchInputError(scrub(f"{root}: cannot be read as Parquet ({' '.join(str(exc).split())})")) from None


def _read_parquet_inputs(root: Location, files: list[Location], output: str | None) -> Inputs:
    import pyarrow.parquet as pq

    columns = pq.read_schema(files[0].path, filesystem=files[0].fs).names
    missing = [c for c in PARQUET_COLUMNS if c not in columns]
    if missing:
        raise BatchInputError(f"{files[0]}: needs columns {list(PARQUET_COLUMNS)}, lacks {missing}")
    names = [
        str(n)
        for f in files
        for n in pq.read_table(f.path, columns=["name"], filesystem=f.fs).column("name").to_pylist()
    ]
    seen: dict[str, int] = {}
    for row, name in enumerate(names):
        if name in seen:
            raise BatchInputError(
                f"{root}: rows {seen[name]} and {row} are both named {name!r}, so both would write its files: "
                "give every row its own name"
            )
        seen[name] = row
    items = dict.fromkeys(names, 1)  # one latent per row
    _refuse_clashes(root, {name: f"row {row} ({name!r})" for name, row in seen.items()}, items, output)
    return Inputs(root, parquet=tuple(files), items=items)


def _planned(root: Location, items: dict[str, int], output: str | None) -> Iterator[tuple[str, str]]:
    """(input name, file name) of every file the inputs write; a name that is no plain file name
    writes none (it fails alone when it is decoded)."""
    folder = OutputFolder(root, output or "png")  # png, jpeg, mp4 ...: one file per item
    for name, n in items.items():
        try:
            paths = folder.paths(name, n)
        except ValueError:
            continue
        yield from ((name, out.name) for out in paths)


def _refuse_clashes(root: Location, described: dict[str, str], items: dict[str, int], output: str | None) -> None:
    """Two inputs whose outputs share a path (x.npy of two items writes x-1.png, as x-1.npy does)."""
    writer: dict[str, str] = {}
    for name, out in _planned(root, items, output):
        if out in writer:
            raise BatchInputError(f"{root}: {writer[out]} and {described[name]} would both write {out}: rename one")
        writer[out] = described[name]


def read_inputs(path: str | Path | Location):
    """A Ray Dataset of inputs: rows {name, path} for a folder of .npy/.safetensors files (each
    file one request's latents, batch dimension first), or {name, latents} from Parquet (each
    row one latent item, no batch dimension; `name` names its output files)."""
    return list_inputs(path).dataset()


def decode_dataset(
    ds,
    config: dict | ServiceConfig,
    output_dir: str | Path | Location,
    *,
    quality: str = "lossless",
    output: str | None = None,
    priority: str = BATCH_PRIORITY,
    concurrency: int = 1,
    num_gpus: float = 0,
    num_cpus: float = 1,
    batch_size: int = 1,
    options: dict | None = None,
    max_restarts: int = 0,
    stop_after_store_failures: int = STOP_AFTER_STORE_FAILURES,
):
    """Decode every row of `ds` ({name, path} or {name, latents} rows, as read_inputs makes them)
    into files under `output_dir` (a local folder, or a store's URI: s3://bucket/prefix, ...).
    Returns the lazy Dataset of per-input results (name, status: decoded | skipped | failed, files,
    items, error, decode_ms); consuming it runs the job.
    `options` are further /decode keys (scaling_factor, height, width, decode_timestep, ...);
    `priority` the scheduler's class every item's request carries (bulk: offline work yields to
    live requests and sessions).
    `stop_after_store_failures`: store failures in a row after which an engine tries no more
    inputs (they become `stopped` rows at once).

    `max_restarts`: an engine that dies is not restarted by default, so the job stops with the
    error and a rerun resumes it. Ray Data would restart it (its default, -1), but with that Ray
    2.60 logs an ERROR on every run, healthy or not, about the engines' constructor arguments being
    in the object store (ray-project/ray#57733); give -1 to have the restarts and the line."""
    config = ServiceConfig.model_validate(config)
    if quality not in QUALITIES:
        raise ValueError(f"quality {quality!r}: one of {list(QUALITIES)}")
    if output is not None and output not in BATCH_OUTPUTS:
        raise ValueError(f"output {output!r}: one of {list(BATCH_OUTPUTS)}")
    if priority not in PRIORITIES:
        raise ValueError(f"priority {priority!r}: one of {list(PRIORITIES)}")
    # checked here (LocationError is a ValueError), before any engine starts; a local path made absolute
    output_dir = (output_dir if isinstance(output_dir, Location) else open_location(str(output_dir))).spec
    from ray.data import ActorPoolStrategy

    with warnings.catch_warnings():
        # Ray 2.60 has no named parameter for max_restarts and calls every extra one deprecated
        # (removed in 2.64), while its own code names `map_batches(..., max_restarts=0)` as the way
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(
            DecodeStage,
            fn_constructor_kwargs={
                "config": config.model_dump(),
                "output_dir": str(output_dir),
                "output": output,
                "quality": quality,
                "options": options,
                "stop_after_store_failures": stop_after_store_failures,
                "priority": priority,
            },
            batch_size=batch_size,
            batch_format="numpy",
            compute=ActorPoolStrategy(size=concurrency),
            num_cpus=num_cpus,
            num_gpus=num_gpus or None,
            max_restarts=max_restarts,
        )


@dataclass
class BatchSummary:
    total: int  # inputs
    counts: Counter = field(default_factory=Counter)  # inputs by status
    failures: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    seconds: float = 0.0
    decoded_items: int = 0  # latent items of the decoded inputs (an input holds one or more)
    stopped_by: str = ""  # the store failure that stopped an engine
    temporaries_removed: int = 0  # left by an earlier run's interrupted writes

    @property
    def done(self) -> int:
        return sum(self.counts.values())

    @property
    def items_per_s(self) -> float:
        """Latent items decoded per second (skipped inputs cost nothing, and are not counted)."""
        return self.decoded_items / self.seconds if self.seconds > 0 else 0.0

    def add(self, row: dict) -> None:
        self.counts[row["status"]] += 1
        if row["status"] == "decoded":
            self.decoded_items += int(row.get("items", 1))
        if row["status"] == "failed":
            self.failures.append((row["name"], row["error"]))
        if row["status"] == "stopped":
            self.stopped_by = self.stopped_by or row["error"]

    def progress_line(self) -> str:
        width = len(str(self.total))
        return (
            f"[{self.done:>{width}}/{self.total} inputs] {self.counts['decoded']} decoded, {self.counts['skipped']} "
            f"skipped, {self.counts['failed']} failed{self._not_tried()}, {self.items_per_s:.2f} items/s"
        )

    def _not_tried(self) -> str:
        return f", {self.counts['stopped']} not tried" if self.counts["stopped"] else ""

    def report(self) -> str:
        lines = [
            f"{self.done} of {self.total} inputs in {self.seconds:.1f} s: {self.counts['decoded']} decoded "
            f"({self.decoded_items} items, {self.items_per_s:.2f} items/s), {self.counts['skipped']} skipped "
            f"(already done), {self.counts['failed']} failed{self._not_tried()}"
        ]
        if self.temporaries_removed:
            lines.append(f"  removed {self.temporaries_removed} temporaries an interrupted run left")
        lines += [f"  failed {name}: {reason}" for name, reason in self.failures[:REPORTED_FAILURES]]
        if len(self.failures) > REPORTED_FAILURES:
            lines.append(f"  ... and {len(self.failures) - REPORTED_FAILURES} more failed")
        if self.stopped_by:
            lines.append(f"  stopped: {self.stopped_by}; what was written is whole, and a rerun resumes from there")
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
    input_path: str | Path | Inputs,
    output_dir: str | Path | Location,
    config: dict | ServiceConfig,
    progress: TextIO | None = None,
    **options,
) -> BatchSummary:
    """list_inputs (or `input_path` already listed) + decode_dataset, consumed here, with a
    progress display on `progress` (e.g. sys.stderr) while it runs; the summary at the end. First
    the temporaries of this job's files that an interrupted run left are removed (one listing of
    the output folder): another job writing the same names into the same folder at once would lose
    its writes, as it would with two jobs writing one file anyway."""
    output = options.get("output")
    inputs = input_path if isinstance(input_path, Inputs) else list_inputs(input_path, output)
    summary = BatchSummary(total=inputs.count)
    folder = OutputFolder(output_dir, output or "png")
    summary.temporaries_removed = folder.discard_temporaries(inputs.output_names(output))
    shown = Progress(progress) if progress is not None else None
    start = time.monotonic()
    for row in decode_dataset(inputs.dataset(), config, output_dir, **options).iter_rows():
        summary.add(row)
        summary.seconds = time.monotonic() - start
        if shown is not None:
            shown.show(summary)
    summary.seconds = time.monotonic() - start
    if shown is not None:
        shown.show(summary, final=True)
    return summary
