"""BENCHMARKS.md: the weight-sync section (`bench.bench_weight_sync`: http, disk, delta and collective against
the machine's limits, and what a delta sends after real optimizer steps)."""

from __future__ import annotations

from typing import Any


def weight_sync(r: dict[str, Any]) -> list[str]:
    lines = [
        "Weight sync over loopback into the real server app (a separate process; fake engine holding tensors of the "
        "same shapes), against the machine's limits measured in the same run on the same bytes: a plain loopback "
        "socket to another process (`raw socket`), one `memcpy`, and a /dev/shm write + read back (`tmpfs`). "
        "`http`: streamed zero-copy safetensors chunks, XXH3-128 per chunk, read by the server's weight-stream port "
        "straight into the staging (`readinto1`, one socket read at a time), swapped on commit; `collective`: a gloo weight group (learner rank 0, "
        "server rank 1), one broadcast per tensor after a metadata check, applied on finish; "
        "`disk`: one snapshot under the run directory (here on a real disk, not a tmpfs) loaded by path; `delta`: http after 1% of the elements changed, scattered (MB/s counts the whole "
        "state dict). Ratios use medians.",
        "",
        "| state dict | path | median s | MB/s median | MB/s best | vs raw socket | vs tmpfs |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in r["sizes"]:
        raw = size["raw_socket"]["mb_per_s_median"]
        tmpfs = size["tmpfs"]["mb_per_s_median"]
        for key in ("raw_socket", "memcpy", "tmpfs", "http", "shm", "disk", "delta", "collective"):
            if key not in size:  # results of an older run
                continue
            row = size[key]
            name = {"raw_socket": "raw socket", "tmpfs": "tmpfs write+read"}.get(key, key)
            if key == "delta":
                name = f"delta ({size['delta_sent_mb']:.1f} MB sent)"
            lines.append(
                f"| {size['state_mb']:.0f} MB | {name} | {row['seconds_median']:.3f} | "
                f"{row['mb_per_s_median']:.0f} | {row['mb_per_s_best']:.0f} | "
                f"{row['mb_per_s_median'] / raw:.2f} | {row['mb_per_s_median'] / tmpfs:.2f} |"
            )
    if "unchanged" in r:
        lines += [
            "",
            "Delta economics after real AdamW steps of the tiny model (`builtin:tiny-qwen2.5-vl` on random tokens, every "
            "parameter trainable, weight decay 0; median over steps 2-3): the share of elements bit-identical to the "
            "step before (all, and among the parameters that got a gradient; the vision tower gets none from text), "
            "and what `sync.delta` sends as a share of a full sync (sparse index + value, or the whole tensor where "
            "cheaper).",
            "",
            "| dtype | lr | unchanged elements | unchanged among trained | delta sends |",
            "|---|---|---|---|---|",
        ]
        for row in r["unchanged"]:
            lines.append(
                f"| {row['dtype']} | {row['lr']:g} | {row['elements']:.1%} | {row['trained_elements']:.1%} | "
                f"{row['delta_bytes']:.1%} |"
            )
    if "sync_fraction" in r:
        lines += ["", r["sync_fraction"]]
    largest = r["sizes"][-1]
    if "ratios" in largest:
        http_ratios = [s["ratios"]["http_over_raw_socket"] for s in r["sizes"]]
        shm_ratios = [s["ratios"]["shm_over_tmpfs"] for s in r["sizes"] if "shm_over_tmpfs" in s["ratios"]]
        disk_ratios = [s["ratios"]["disk_over_tmpfs"] for s in r["sizes"] if "disk_over_tmpfs" in s["ratios"]]

        def verdict(values: list[float]) -> str:
            shown = " / ".join(f"{v:.2f}" for v in values)
            return f"{shown} ({'met' if min(values) >= 0.5 else 'not met'})"

        tmpfs_target = (
            f"shm >= 0.5 of tmpfs write+read -- {verdict(shm_ratios)}"
            if shm_ratios
            else f"disk >= 0.5 of tmpfs write+read -- {verdict(disk_ratios)}"
        )
        sizes_shown = " / ".join(f"{s['state_mb']:.0f} MB" for s in r["sizes"])
        lines += [
            "",
            f"Targets (by size, {sizes_shown}): http >= 0.5 of the raw "
            f"socket -- {verdict(http_ratios)}; {tmpfs_target}. "
            "What limits http now: the learner writes each chunk with `sendall` straight from the tensors' memory "
            "(`http.client` on a TCP_NODELAY connection to the server's weight-stream port), the server reads it "
            "with `readinto1` (one socket read at a time, under the body deadline) straight into the staging and hashes it in place (XXH3-128, ~28 GB/s; sha256 at "
            "~1.8 GB/s capped the first path). What remains above the raw socket is per sync and per chunk: the "
            "/version/ query for the stream port, one request round trip per chunk, the commit, and the engine's "
            "copy of the staging into its weights (one memcpy of the state dict, under the generation lock). "
            "Before: chunks through uvicorn/h11 on the app port reached 0.20-0.28 of the raw socket, and every "
            "request to the server paid a ~44 ms delayed-ACK stall (the listening socket was not created as TCP, "
            "so asyncio never set TCP_NODELAY; fixed). disk pays one write of the snapshot, one read of it by the "
            "server and one copy into the engine; collective pays gloo's framing and one copy per tensor on each "
            "side. "
            "The machine is shared"
            + (
                f" (1-minute load average {r['loadavg'][0]:.1f} at the start, {r['loadavg'][1]:.1f} at the end)"
                if "loadavg" in r
                else ""
            )
            + ": absolute figures move 2-3x between runs, the ratios within one run much less.",
        ]
    return lines
