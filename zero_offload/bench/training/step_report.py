"""``zero-offload bench step``'s summaries and tables: the prefetch-depth sweep, the host/NVMe
split sweep and the overlap ratios derived from the runs' medians, and the Markdown tables
printed from the report (``step_run`` runs the steps)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .step_run import RunResult

__all__ = ["REFERENCE_DEPTH", "depth_sweep", "fraction_sweep", "overlap_ratios", "print_tables"]

REFERENCE_DEPTH = 2  # the library's default prefetch_depth; the resident run uses it

_RUN_COLUMNS = (
    "offload opt / param",
    "depth",
    "fwd s",
    "bwd s",
    "step s",
    "total s",
    "peak RSS GiB",
    "opt read s",
    "opt compute s",
    "opt write s",
    "disk busy s",
    "opt wall s",
    "overlap",
    "NVMe GB/s",
    "vs raw disk",
)


def fraction_sweep(results: list[RunResult]) -> list[dict[str, Any]]:
    """Step time and optimizer disk bytes per fraction, and both relative to all on NVMe."""
    points = [r for r in results if r.optimizer_fraction is not None]
    ref = next((r for r in points if r.optimizer_fraction == 1.0 and not r.error), None)
    rows = []
    for r in points:
        row: dict[str, Any] = {
            "optimizer_fraction": r.optimizer_fraction,
            "error": r.error,
            "total_s": None,
            "opt_wall_s": None,
            "disk_bytes": None,
            "time_vs_all_nvme": None,
            "disk_vs_all_nvme": None,
        }
        if not r.error:
            m = r.median
            row.update(
                total_s=m["total_s"],
                opt_wall_s=m["opt_wall_s"],
                disk_bytes=m["bytes_read"] + m["bytes_written"],
            )
            if ref is not None:
                rm = ref.median
                row["time_vs_all_nvme"] = m["total_s"] / rm["total_s"]
                ref_bytes = rm["bytes_read"] + rm["bytes_written"]
                row["disk_vs_all_nvme"] = row["disk_bytes"] / ref_bytes if ref_bytes else None
        rows.append(row)
    return rows


def depth_sweep(results: list[RunResult], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Step time per depth, and its ratio to the resident stage-3 run with the same optimizer
    and ``overlap_step``."""
    rows = []
    for r in results:
        if r.offload_param != args.offload_param or r.prefetch_depth not in args.prefetch_depth:
            continue
        ref = next(
            (
                x
                for x in results
                if x.offload_param == "none"
                and x.offload_optimizer == r.offload_optimizer
                and x.prefetch_depth == REFERENCE_DEPTH
                and x.overlap_step == r.overlap_step
                and not x.error
            ),
            None,
        )
        total = None if r.error else r.median["total_s"]
        ratio = total / ref.median["total_s"] if ref and total else None
        rows.append(
            {
                "offload_optimizer": r.offload_optimizer,
                "offload_param": r.offload_param,
                "prefetch_depth": r.prefetch_depth,
                "overlap_step": r.overlap_step,
                "total_s": total,
                "ratio_to_resident": ratio,
                "error": r.error,
            }
        )
    return rows


def overlap_ratios(results: list[RunResult]) -> list[dict[str, Any]]:
    """Per configuration run with and without ``overlap_step``: both step times and their
    ratio (below 1: the forward hid part of the optimizer phase)."""
    rows = []
    for on in (r for r in results if r.overlap_step and not r.error):
        off = next(
            (
                r
                for r in results
                if not r.overlap_step
                and not r.error
                and (r.offload_optimizer, r.offload_param, r.prefetch_depth, r.optimizer_fraction)
                == (
                    on.offload_optimizer,
                    on.offload_param,
                    on.prefetch_depth,
                    on.optimizer_fraction,
                )
            ),
            None,
        )
        if off is not None:
            t_on, t_off = on.median["total_s"], off.median["total_s"]
            rows.append({"run": on.label, "off_s": t_off, "on_s": t_on, "ratio": t_on / t_off})
    return rows


def _short(error: str) -> str:
    """The table cell for a failed run: its first words, not the whole message."""
    return error.split(" (", 1)[0].splitlines()[0]


def print_tables(report: dict) -> None:
    m = report["model"]
    print(
        f"bench step: GPT {m['layers']} layers x width {m['width']}, {m['params'] / 1e6:.0f}M "
        "params, "
        f"seq {m['seq']}, batch {report['batch']}, {report['dtype']}, stage {report['stage']}, "
        f"{report['device']}, {report['threads']} threads; median of {report['steps']} steps "
        f"after {report['warmup']} warm-up"
    )
    load = report["load_average"]
    if max(load.values()) > 0.5 * (report["cpus"] or 1):
        print(
            f"note: 1-min load average {load['start']:.1f} at start, {load['end']:.1f} at end on "
            f"{report['cpus']} CPUs: other work shares this host and skews these numbers"
        )
    b = report["baseline"]
    if b:
        print(
            f"raw O_DIRECT on {report['nvme_path']} ({b['size'] / 2**30:.2f} GiB, one thread, 64 "
            f"MiB requests): read {b['read_gbps']:.2f} GB/s, write {b['write_gbps']:.2f} GB/s"
        )
    print()
    print("| " + " | ".join(_RUN_COLUMNS) + " |")
    print("|---" * len(_RUN_COLUMNS) + "|")
    for r in report["runs"]:
        opt = (
            r["offload_optimizer"]
            + ("" if r.get("optimizer_fraction") is None else f" ({r['optimizer_fraction']})")
            + ("" if r.get("overlap_step", True) else " (no overlap)")
        )
        head = f"| {opt} / {r['offload_param']} | {r['prefetch_depth']} |"
        if r["error"]:
            print(f"{head} {_short(r['error'])} |" + " |" * (len(_RUN_COLUMNS) - 3))
            continue
        d = r["median"]
        gbps = f"{r['nvme_gbps']:.2f}" if r["nvme_gbps"] else "-"
        eff = f"{r['io_efficiency']:.2f}" if r["io_efficiency"] else "-"
        peak = f"{r['peak_rss'] / 2**30:.2f}" if r.get("peak_rss") else "-"
        print(
            f"{head} {d['fwd_s']:.3f} | {d['bwd_s']:.3f} | {d['step_s']:.3f} | "
            f"{d['total_s']:.3f} | {peak} | "
            f"{d['opt_read_s']:.3f} | "
            f"{d['opt_compute_s']:.3f} | {d['opt_write_s']:.3f} | {d['opt_io_busy_s']:.3f} | "
            f"{d['opt_wall_s']:.3f} | {d['overlap']:.2f} | "
            f"{gbps} | {eff} |"
        )
    if report["sweep"]:
        print()
        print("| offload opt / param | prefetch depth | step s | / resident stage 3 (depth 2) |")
        print("|---|---|---|---|")
        for row in report["sweep"]:
            step = f"{row['total_s']:.3f}" if row["total_s"] else _short(row["error"] or "-")
            ratio = f"{row['ratio_to_resident']:.2f}" if row["ratio_to_resident"] else "-"
            depth = f"{row['prefetch_depth']}" + ("" if row["overlap_step"] else " (no overlap)")
            print(
                f"| {row['offload_optimizer']} / {row['offload_param']} | {depth} "
                f"| {step} | {ratio} |"
            )
    if report.get("fraction_sweep"):
        print()
        print(
            "| optimizer on NVMe | step s | opt wall s | optimizer disk GB/step | "
            "step / all NVMe | disk / all NVMe |"
        )
        print("|---|---|---|---|---|---|")
        for row in report["fraction_sweep"]:
            if row["error"]:
                print(f"| {row['optimizer_fraction']} | {_short(row['error'])} | | | | |")
                continue
            ratios = [
                f"{row[k]:.2f}" if row[k] is not None else "-"
                for k in ("time_vs_all_nvme", "disk_vs_all_nvme")
            ]
            print(
                f"| {row['optimizer_fraction']} | {row['total_s']:.3f} | "
                f"{row['opt_wall_s']:.3f} | {row['disk_bytes'] / 1e9:.3f} | {ratios[0]} | "
                f"{ratios[1]} |"
            )
    if report.get("overlap"):
        print()
        print("| run | step s, update after step() | step s, under the next forward | ratio |")
        print("|---|---|---|---|")
        for row in report["overlap"]:
            print(f"| {row['run']} | {row['off_s']:.3f} | {row['on_s']:.3f} | {row['ratio']:.2f} |")
    print()
    print(
        "overlap = max(disk busy, compute) / wall of the optimizer phase (disk busy: time with any "
        "request in flight; read and write columns sum each request, submit to completion, so they "
        "overlap). vs raw disk = max(bytes at raw GB/s, compute) / wall. With overlap_step on, "
        "the optimizer's wall runs from step() into the next forward: compare those two columns "
        "with --overlap-step off."
    )
