"""``zero-offload bench io``: our file engine against raw direct I/O, same file, same run.

The baseline is fio (``--direct=1 --iomem=shmhuge``) when fio is installed and enough
hugetlb pages are reserved, else a plain single-threaded O_DIRECT loop of 64 MiB requests in
Python over one huge-page buffer. Both sides use huge-page buffers, rounds are interleaved
(alternating who goes first), the file is filled untimed first so no side pays for block
allocation, and the page cache is never measured: a path without O_DIRECT is refused.

Run: ``python -m zero_offload.bench.micro.io --path DIR [--size 4GiB] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...progress import clear_status, show_status
from ...quantities import parse_size
from ...swap.buffers import HostBuffer
from ...swap.io import DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, FileIOEngine

RAW_CHUNK = 64 * 1024 * 1024
"""Request size of the Python baseline loop (measured best of 8/64/512 MiB)."""
MAX_BUFFER = 512 * 1024 * 1024
"""Host buffer both sides use; requests cycle through it so a 4 GiB file needs no 4 GiB of RAM."""
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
FIO_BS, FIO_IODEPTH = 8 * 1024 * 1024, 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zero-offload bench io``."""
    parser.add_argument(
        "--path",
        required=True,
        type=Path,
        help="directory on the disk to test (a temp file is made and removed)",
    )
    parser.add_argument(
        "--size", type=parse_size, default=4 * 2**30, help="file size (default 4GiB)"
    )
    parser.add_argument(
        "--block-size",
        type=parse_size,
        default=DEFAULT_BLOCK_SIZE,
        help="engine bytes per syscall (default %(default)s)",
    )
    parser.add_argument(
        "--queue-depth",
        type=int,
        default=DEFAULT_QUEUE_DEPTH,
        help="engine blocks in flight (default %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--baseline",
        choices=["auto", "fio", "python"],
        default="auto",
        help="raw baseline (default auto: fio if usable)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )


@dataclass
class OpResult:
    """GB/s per round for one operation."""

    ours: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)

    def ratio(self) -> float:
        return statistics.median(self.ours) / statistics.median(self.baseline)


def fs_type(directory: Path) -> str:
    """Filesystem type of the mount holding ``directory`` (from /proc/mounts), '' if unknown."""
    best, kind = "", ""
    target = str(directory.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                best
            ):
                best, kind = mnt, parts[2]
    except (OSError, IndexError):
        pass
    return kind


def _hugetlb_free_bytes() -> int:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return int(info["HugePages_Free"].split()[0]) * int(info["Hugepagesize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def _fio_usable() -> str | None:
    """None if fio can run with huge-page buffers here, else why not."""
    if shutil.which("fio") is None:
        return "fio not installed"
    if _hugetlb_free_bytes() < FIO_BS * FIO_IODEPTH + 2**21:
        return "no free hugetlb pages for fio --iomem=shmhuge (vm.nr_hugepages)"
    return None


def _fio(path: Path, op: str, size: int) -> float:
    cmd = [
        "fio",
        "--name=zo_bench",
        f"--filename={path}",
        f"--rw={op}",
        f"--bs={FIO_BS}",
        f"--iodepth={FIO_IODEPTH}",
        "--ioengine=libaio",
        "--direct=1",
        "--iomem=shmhuge",
        f"--size={size}",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job[op]["bw_bytes"] / 1e9


def raw_direct_io(path: Path, op: str, size: int, buf: HostBuffer) -> float:
    view = buf.tensor.numpy().data
    flags = (os.O_RDONLY if op == "read" else os.O_WRONLY | os.O_CREAT) | os.O_DIRECT
    call = os.preadv if op == "read" else os.pwritev
    fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, RAW_CHUNK):
            n = min(RAW_CHUNK, size - off)
            pos = off % buf.nbytes
            if call(fd, [view[pos : pos + n]], off) != n:
                raise OSError(f"short {op} at {off}")
        return size / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def _ours(engine: FileIOEngine, path: Path, op: str, size: int, buf: HostBuffer) -> float:
    submit = engine.read if op == "read" else engine.write
    t0 = time.perf_counter()
    futures = [
        submit(path, buf.tensor[: min(buf.nbytes, size - off)], off)
        for off in range(0, size, buf.nbytes)
    ]
    for f in futures:
        f.result()
    return size / (time.perf_counter() - t0) / 1e9


def check_path(directory: Path, size: int) -> str | None:
    """None if the directory can host the test file with O_DIRECT, else why not."""
    if not directory.is_dir():
        return f"--path {directory} is not a directory"
    free = shutil.disk_usage(directory).free
    if free < size + 2**28:
        return (
            f"--path {directory} has {free / 2**30:.2f} GiB free; the test needs "
            f"{size / 2**30:.2f} GiB + 256 MiB"
        )
    if fs_type(directory) in MEMORY_FILESYSTEMS:
        return (
            f"--path {directory} is on {fs_type(directory)}, which lives in memory; it would "
            "not measure a disk"
        )
    probe = directory / f".zo_bench_probe_{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as exc:
        if exc.errno == 22:
            return (
                f"--path {directory}: the filesystem refuses O_DIRECT (tmpfs?); it would "
                "measure the page cache, not the disk"
            )
        return f"--path {directory}: cannot create a file there: {exc.strerror}"
    finally:
        probe.unlink(missing_ok=True)
    return None


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 2 when the path cannot be measured."""
    size = (args.size // 4096) * 4096
    block = args.block_size
    if size <= 0 or args.rounds < 1 or args.queue_depth < 1 or block < 4096 or block % 4096:
        print(
            "bench io: need --size >= 4KiB, --rounds >= 1, --queue-depth >= 1, --block-size a "
            "positive multiple of 4KiB",
            file=sys.stderr,
        )
        return 2
    why = check_path(args.path, size)
    if why:
        print(f"bench io: {why}", file=sys.stderr)
        return 2
    fio_why = _fio_usable()
    if getattr(args, "baseline", "auto") == "fio" and fio_why:
        print(f"bench io: --baseline fio impossible: {fio_why}", file=sys.stderr)
        return 2
    use_fio = getattr(args, "baseline", "auto") != "python" and fio_why is None
    path = args.path / f"zo_bench_io_{os.getpid()}.dat"
    results = {"write": OpResult(), "read": OpResult()}
    try:
        show_status(f"bench io: allocating {min(size, MAX_BUFFER) >> 20} MiB huge-page buffer")
        buf = HostBuffer(min(size, MAX_BUFFER))
        show_status(f"bench io: filling {size / 2**30:.2f} GiB test file (untimed)")
        raw_direct_io(path, "write", size, buf)
        baseline: Callable[[str], float] = (
            (lambda op: _fio(path, op, size))
            if use_fio
            else (lambda op: raw_direct_io(path, op, size, buf))
        )
        with FileIOEngine(args.block_size, args.queue_depth) as engine:
            for r in range(args.rounds):
                for op in ("write", "read"):
                    order = [
                        ("baseline", baseline),
                        ("ours", lambda o: _ours(engine, path, o, size, buf)),
                    ]
                    for name, fn in order if r % 2 == 0 else order[::-1]:
                        show_status(f"bench io: round {r + 1}/{args.rounds} {op} {name}")
                        getattr(results[op], name).append(fn(op))
        buf.close()
    finally:
        path.unlink(missing_ok=True)
        clear_status()
    base_name = (
        f"fio libaio --direct=1 --iomem=shmhuge bs={FIO_BS >> 20}MiB iodepth={FIO_IODEPTH}"
        if use_fio
        else f"python O_DIRECT loop, one thread, {RAW_CHUNK >> 20} MiB requests, huge-page buffer"
    )
    report = {
        "path": str(args.path),
        "size": size,
        "rounds": args.rounds,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "baseline": base_name,
        "baseline_note": None if use_fio else fio_why,
        "results": {op: {**asdict(res), "ratio": res.ratio()} for op, res in results.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def _print_table(report: dict) -> None:
    def mmm(xs: list[float]) -> str:
        return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"

    print(
        f"bench io: {report['size'] / 2**30:.2f} GiB file in {report['path']}, O_DIRECT, "
        f"{report['rounds']} interleaved rounds"
    )
    print(
        f"ours:     FileIOEngine block_size={report['block_size'] >> 10} KiB "
        f"queue_depth={report['queue_depth']}, huge-page buffer"
    )
    print(
        f"baseline: {report['baseline']}"
        + (f" ({report['baseline_note']})" if report["baseline_note"] else "")
    )
    print()
    print(
        "| op | baseline GB/s (min / median / max) | ours GB/s (min / median / max) | ours / "
        "baseline (median) |"
    )
    print("|---|---|---|---|")
    for op in ("read", "write"):
        res = report["results"][op]
        print(f"| {op} | {mmm(res['baseline'])} | {mmm(res['ours'])} | {res['ratio']:.2f} |")


def disk_baseline(directory: Path, size: int) -> dict[str, float]:
    """Raw O_DIRECT GB/s on ``directory``: one thread, 64 MiB requests, huge-page buffer
    (``bench io``'s baseline loop); the file is written once untimed first."""
    size = max(4096, size // 4096 * 4096)
    path = directory / f"zo_bench_step_{os.getpid()}.dat"
    buf = HostBuffer(min(size, 512 * 2**20))
    try:
        raw_direct_io(path, "write", size, buf)
        return {
            "size": size,
            "write_gbps": raw_direct_io(path, "write", size, buf),
            "read_gbps": raw_direct_io(path, "read", size, buf),
        }
    finally:
        buf.close()
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_offload.bench.micro.io", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
