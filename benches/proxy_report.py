"""The report of benches/proxy.sh: medians of its rounds, ratios per round,
and fairgate's own time per exchange read from its results.

Reads the figures from the environment, as the script exports them: for
each target (direct, nginx, passthrough, fairgate) and figure, a
space-separated list with one value per round (RPS_nginx, USR_fairgate,
...), and WINDOW_LIST, the spans of epoch milliseconds of fairgate's
fixed-rate runs.
"""

import glob
import json
import os
import statistics

TARGETS = ("direct", "nginx", "passthrough", "fairgate")
# fairgate on a route it passes through unguarded: its HTTP hop alone.
LABELS = {"passthrough": "fairgate, unguarded route"}


def values(name, target):
    return [float(v) for v in os.environ[f"{name}_{target}"].split()]


def med(name, target):
    return statistics.median(values(name, target))


def cpu(prefix, target):
    """CPU per exchange of each round, user + system."""
    return [u + s for u, s in zip(values(prefix + "USR", target), values(prefix + "SYS", target))]


def cpu_cell(prefix, target):
    """The median of user + system, then the medians of each (which need
    not add up to it)."""
    if target == "direct":
        return ""
    user, system = med(prefix + "USR", target), med(prefix + "SYS", target)
    return f"{statistics.median(cpu(prefix, target)):.1f} ({user:.1f} + {system:.1f})"


def queue_cell(prefix, target):
    """The median CPU of fairgate's side-queue thread per exchange, and
    its share of the process's in each round."""
    if target != "fairgate":
        return ""
    queue = values(prefix + "QCPU", target)
    shares = ", ".join(f"{q / c:.0%}" for q, c in zip(queue, cpu(prefix, target)))
    return f"{statistics.median(queue):.1f} ({shares})"


def show(label, ratios):
    rounds = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"{label}: {statistics.median(ratios):.2f}   (rounds: {rounds})")


def own_times():
    """proxy_ms of fairgate's records of its fixed-rate runs."""
    windows = [tuple(map(int, w.split("-"))) for w in os.environ["WINDOW_LIST"].split()]
    times = []
    for path in glob.glob(os.path.join(os.environ["WORK"], "data", "results", "*.jsonl")):
        with open(path) as lines:
            for line in lines:
                record = json.loads(line).get("exchange")
                if record and any(a <= record["started_ms"] <= b for a, b in windows):
                    times.append(record["proxy_ms"])
    return sorted(times)


def main():
    connections, rate = os.environ["CONCURRENCY"], os.environ["RATE"]
    rows = [
        (f"requests/s, {connections} connections", lambda t: f"{med('RPS', t):,.0f}"),
        ("CPU per request (user + system), µs", lambda t: cpu_cell("", t)),
        ("of which the side queue's thread, µs", lambda t: queue_cell("", t)),
        (f"p50 / p99 at {rate} req/s, ms", lambda t: f"{med('P50S', t):.3f} / {med('P99S', t):.3f}"),
        (f"streams/s, {connections} connections", lambda t: f"{med('SRPS', t):,.0f}"),
        ("CPU per stream (user + system), µs", lambda t: cpu_cell("S", t)),
        ("of which the side queue's thread, µs", lambda t: queue_cell("S", t)),
        (f"stream time to first byte p50 / p99 at {rate} streams/s, ms",
         lambda t: f"{med('T50S', t):.3f} / {med('T99S', t):.3f}"),
    ]
    print()
    print(f"Medians of {os.environ['ROUNDS']} rounds taken in turn across the targets:")
    print()
    print(f"| | {' | '.join(LABELS.get(t, t) for t in TARGETS)} |")
    print("| --- | " + " | ".join("---:" for _ in TARGETS) + " |")
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(t) for t in TARGETS) + " |")
    print()

    def per_round(xs, ys):
        return [x / y for x, y in zip(xs, ys)]

    show("throughput, fairgate / direct", per_round(values("RPS", "fairgate"), values("RPS", "direct")))
    show("throughput, nginx / direct", per_round(values("RPS", "nginx"), values("RPS", "direct")))
    show("throughput, fairgate unguarded / direct", per_round(values("RPS", "passthrough"), values("RPS", "direct")))
    # The load generator and the mock share the machine's cores with the
    # proxy, so a proxy's throughput follows from its CPU per request: if
    # the direct loop keeps every core busy, each request costs the load
    # generator and the mock `cores / direct requests/s`, and a proxy
    # adding `c` seconds of CPU per request reaches that / (that + c) of
    # direct.
    cores = os.cpu_count() or 1
    for target in ("fairgate", "nginx"):
        implied = [
            (cores / d) / (cores / d + c * 1e-6)
            for d, c in zip(values("RPS", "direct"), cpu("", target))
        ]
        show(f"  throughput its CPU per request implies on {cores} shared cores, {target}", implied)
    show("CPU per request, fairgate / nginx", per_round(cpu("", "fairgate"), cpu("", "nginx")))
    show("CPU per stream, fairgate / nginx", per_round(cpu("S", "fairgate"), cpu("S", "nginx")))
    # The floor under those: fairgate's hop with no guard, no record, no
    # side-queue work.
    show("CPU per request, fairgate unguarded / nginx", per_round(cpu("", "passthrough"), cpu("", "nginx")))
    show("CPU per stream, fairgate unguarded / nginx", per_round(cpu("S", "passthrough"), cpu("S", "nginx")))
    # The side queue's thread runs the in-process workers (quality
    # metrics, result lines): work done for the record, not for the hop,
    # which `queue.kind: nats` moves to worker processes.
    for prefix, what in (("", "request"), ("S", "stream")):
        serving = [c - q for c, q in zip(cpu(prefix, "fairgate"), values(prefix + "QCPU", "fairgate"))]
        show(f"CPU per {what} less the side-queue thread, fairgate / nginx", per_round(serving, cpu(prefix, "nginx")))
    for figure, what in (("P99S", f"p99 at {rate} req/s"), ("T99S", f"p99 time to first byte at {rate} streams/s")):
        direct = values(figure, "direct")
        for target in ("fairgate", "passthrough", "nginx"):
            added = [p - d for p, d in zip(values(figure, target), direct)]
            show(f"added {what}, {LABELS.get(target, target)}, ms", added)
    own = own_times()
    if own:
        def quantile(q):
            return own[min(len(own) - 1, int(len(own) * q))]
        print(
            f"fairgate's own time per exchange at {rate} req/s (its records: total minus upstream, "
            f"{len(own):,} exchanges): p50 {quantile(0.5):.3f} ms, p99 {quantile(0.99):.3f} ms"
        )
    print(f"fairgate peak RSS over the run, which ends with 256 concurrent streams: {os.environ['PEAK']} MB")


if __name__ == "__main__":
    main()
