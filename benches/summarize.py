"""Summarises the runs of `scripts/bench.sh` (throughput mode): per run and medians.

Usage: summarize.py DIR EVENTS RUNS, where DIR holds ceiling_rN and rN/{worker.log, restore.log,
started, restarted, peak_kib, verify} as bench.sh writes them.
"""

import os
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


def ts(text):
    m = TS.match(text.strip())
    if not m:
        raise ValueError(f"no timestamp in {text[:60]!r}")
    return datetime.fromisoformat(m.group(1)[:26])


def field(line, name):
    m = re.search(rf" {name}=(\d+)", line)
    return int(m.group(1)) if m else None


def pct(values, p):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round((len(values) - 1) * p))]


def cpu_seconds(path):
    """`name=seconds` lines (bench.sh's CPU accounting), or None for a run without them."""
    if not path.exists():
        return None
    pairs = (line.rsplit("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k: float(v) for k, v in pairs}


def run(d, r, events):
    base = d / f"r{r}"
    started = ts((base / "started").read_text())
    lines = (base / "worker.log").read_text().splitlines()
    committed = [l for l in lines if "checkpoint committed" in l and " millis=" in l]
    consumed, done = 0, None
    pauses, cuts, waits, latencies = [], [], [], []
    state_bytes = changelog_bytes = 0
    for line in committed:
        state_bytes += field(line, "state_bytes") or 0
        changelog_bytes += field(line, "changelog_bytes") or 0
        consumed += field(line, "consumed") or 0
        latency = field(line, "millis")
        pause_us = field(line, "pause_us")
        latencies.append(latency)
        # A build without pipelined checkpoints stops consuming for the whole commit.
        pauses.append(pause_us / 1000 if pause_us is not None else latency)
        # The pause is the cut plus any wait for the committer (builds before the split log
        # no backpressure_us: all of their pause counts as the cut).
        wait_us = field(line, "backpressure_us") or 0
        waits.append(wait_us / 1000)
        cuts.append(pauses[-1] - wait_us / 1000)
        if done is None and consumed >= events:
            done = ts(line)
    if done is None:
        raise SystemExit(f"run {r}: only {consumed} of {events} records committed")
    seconds = (done - started).total_seconds()
    restarted = ts((base / "restarted").read_text())
    resumed = next(l for l in (base / "restore.log").read_text().splitlines() if "resuming partition from checkpoint" in l)
    ceiling = float(re.search(r"records_per_s=(\d+)", (d / f"ceiling_r{r}").read_text()).group(1))
    # Builds with a changelog: a restore from it into an empty directory.
    from_changelog = base / "changelog_restore"
    changelog_restore = None
    if from_changelog.exists():
        m = re.search(r"in ([0-9.]+) s", from_changelog.read_text())
        changelog_restore = float(m.group(1)) if m else None
    tally = events / seconds
    return {
        "ceiling": ceiling,
        "tally": tally,
        "ratio": tally / ceiling,
        "pause_p50": pct(pauses, 0.5),
        "pause_p99": pct(pauses, 0.99),
        "cut_p99": pct(cuts, 0.99),
        "waited": sum(1 for w in waits if w > 0.5),
        "commit_p50": pct(latencies, 0.5),
        "commit_p99": pct(latencies, 0.99),
        "restore_s": (ts(resumed) - restarted).total_seconds(),
        "rss_mib": int((base / "peak_kib").read_text()) / 1024,
        "checkpoints": len(committed),
        "changelog_per_state": changelog_bytes / state_bytes if state_bytes else float("nan"),
        "changelog_mib": changelog_bytes / 2**20,
        "changelog_restore_s": changelog_restore if changelog_restore is not None else float("nan"),
        "verify": (base / "verify").read_text().strip().replace("\n", "; "),
        "ceiling_cpu": cpu_seconds(d / f"ceiling_r{r}.cpu"),
        "cpu": cpu_seconds(base / "cpu"),
    }


def main():
    d, events, runs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rows = [run(d, r, events) for r in range(1, runs + 1)]
    print(f"\n{events} records, {runs} runs")
    print(f"{'run':>4} {'ceiling/s':>10} {'tally/s':>9} {'ratio':>6} {'pause p50/p99 ms':>19} "
          f"{'cut p99 ms':>10} {'waited':>6} "
          f"{'commit p50/p99 ms':>18} {'restore s':>9} {'RSS MiB':>8} {'ckpts':>6}")
    for i, x in enumerate(rows, 1):
        print(f"{i:>4} {x['ceiling']:>10.0f} {x['tally']:>9.0f} {x['ratio']:>6.2f} "
              f"{x['pause_p50']:>9.3f}/{x['pause_p99']:<9.3f} {x['cut_p99']:>10.3f} {x['waited']:>6} "
              f"{x['commit_p50']:>9}/{x['commit_p99']:<8} "
              f"{x['restore_s']:>9.2f} {x['rss_mib']:>8.0f} {x['checkpoints']:>6}")
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k not in ("verify", "ceiling_cpu", "cpu")}
    print(f"median: ceiling={med['ceiling']:.0f}/s tally={med['tally']:.0f}/s ratio={med['ratio']:.2f} "
          f"pause_p50={med['pause_p50']:.3f}ms pause_p99={med['pause_p99']:.3f}ms cut_p99={med['cut_p99']:.3f}ms "
          f"commit_p50={med['commit_p50']:.0f}ms commit_p99={med['commit_p99']:.0f}ms "
          f"restore={med['restore_s']:.2f}s peak_rss={med['rss_mib']:.0f}MiB")
    print(f"changelog: {med['changelog_mib']:.0f} MiB, {med['changelog_per_state']:.2f}x the state changes' bytes; "
          f"restore from it into an empty directory {med['changelog_restore_s']:.2f}s")
    cpu_per_record(rows, events, med["ceiling"])
    for i, x in enumerate(rows, 1):
        print(f"run {i}: {x['verify']}")


def cpu_per_record(rows, events, ceiling):
    """Where the CPU of a record goes, medians over runs, against what a ratio of 0.7 leaves."""
    if any(x["cpu"] is None or x["ceiling_cpu"] is None for x in rows):
        return

    def us(values):
        return statistics.median(values) * 1e6 / events

    reader = {k: us([x["ceiling_cpu"][k] for x in rows]) for k in ("consumer", "broker")}
    threads = sorted({k for x in rows for k in x["cpu"] if k.startswith("thread ")})
    worker = {k[7:]: us([x["cpu"].get(k, 0.0) for x in rows]) for k in threads}
    services = {k: us([x["cpu"][k] for x in rows]) for k in ("broker", "clickhouse")}
    total = sum(worker.values()) + sum(services.values())
    cores = len(os.sched_getaffinity(0))
    budget = cores * 1e6 / (0.7 * ceiling)
    print(f"cpu per record: ceiling {sum(reader.values()):.2f} us (consumer {reader['consumer']:.2f}, "
          f"broker {reader['broker']:.2f}); tally {total:.2f} us (worker {sum(worker.values()):.2f}, "
          f"broker {services['broker']:.2f}, clickhouse {services['clickhouse']:.2f})")
    top = sorted(worker.items(), key=lambda kv: -kv[1])[:6]
    print("worker threads, us per record: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    print(f"at ratio=0.70 a record may cost {budget:.2f} us of CPU in all "
          f"({cores} cores / (0.7 x the ceiling)); tally's costs {total / budget:.1f}x that")


main()
