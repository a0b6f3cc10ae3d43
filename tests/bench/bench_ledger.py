"""The usage ledger from an event loop: requests/s onto disk, how long the loop is held meanwhile,
and `spent()` calls/s. A "row" below is one request's UsageRow as `record()` takes it; the ledger
sums a second's requests of one tenant, key, model, ... into one row of its file.

(a) `record()` is called for `--rows` rows as fast as the loop can (bursts of `--burst` rows, then
    one turn of the loop) while a probe task sleeps 1 ms again and again and measures how late it
    wakes; then the loop awaits `flush()` in a thread. Rows/s is from the first `record()` to the end
    of the flush (so it is the writer's rate onto disk), beside the probe's lateness (p50, p99, max)
    and the longest single `record()` call; beside it, the same probe for a second before any row
    (the machine's own noise: other processes on its cores wake the loop late too).
(a2) rows at a steady `--paced-rate` (the target's 5,000 rows/s), as a busy proxy records them:
    the probe's lateness and the longest `record()` call.
(b) `spent()` on the file (a) and (a2) wrote, per request as the edge calls it: a budget's period
    (the same start every call: its sum is kept and only the rows added since are read) and a
    per-minute window (a start that moves forward every call: the kept sum is moved, reading the
    rows it left and those added), then the budget again with rows still queued.

The targets (issue 32): at least 5,000 rows/s, and the loop held no more than 5 ms at a time.

    .venv/bin/python tests/bench/bench_ledger.py [--rows 50000] [--burst 50] [--tenants 10] [--paced-rate 5000]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this tree's proxy/, not an installed copy

from proxy.tenants.ledger import SqliteLedger, UsageRow  # noqa: E402

TARGET_ROWS_PER_S = 5000
TARGET_LAG_MS = 5.0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def row(i: int, tenants: int, start: float) -> UsageRow:
    return UsageRow(time=start + i * 0.001, tenant=f"tenant{i % tenants}", key_id=f"k{i % (2 * tenants)}",
                    model=("qwen", "llama", "gpt")[i % 3], backend="llama_server", host="local",
                    status=200 if i % 50 else 429, prompt_tokens=100 + i % 900, cached_tokens=i % 64,
                    output_tokens=1 + i % 500, cost=0.0001 * (i % 7), queue_wait_ms=0.5, duration_ms=120.0)


async def probe(stop: asyncio.Event, lags_ms: list[float]) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lags_ms.append((time.perf_counter() - before - 0.001) * 1000)


async def record_all(ledger: SqliteLedger, n: int, tenants: int, start_time: float,
                     burst: int) -> tuple[float, float]:
    """Seconds from the first record() to the end of the flush, and the longest record() call. Each
    row is built just before it is recorded, as a finished request builds it."""
    longest = 0.0
    start = time.perf_counter()
    for i in range(0, n, burst):
        for j in range(i, min(n, i + burst)):
            usage = row(j, tenants, start_time)
            before = time.perf_counter()
            ledger.record(usage)
            longest = max(longest, time.perf_counter() - before)
        await asyncio.sleep(0)
    await asyncio.to_thread(ledger.flush)
    return time.perf_counter() - start, longest


async def record_paced(ledger: SqliteLedger, rate: float, seconds: float, tenants: int,
                       start_time: float) -> tuple[int, float]:
    """Rows recorded at a steady `rate` (as many each millisecond tick as the rate asks), then the
    flush awaited: how many, and the longest record() call."""
    longest = 0.0
    done = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(int(elapsed * rate) - done):
            usage = row(done, tenants, start_time)
            before = time.perf_counter()
            ledger.record(usage)
            longest = max(longest, time.perf_counter() - before)
            done += 1
        await asyncio.sleep(0.001)
    await asyncio.to_thread(ledger.flush)
    return done, longest


def spent_rate(ledger: SqliteLedger, tenants: int, since: float, sliding_from: float | None, seconds: float) -> float:
    calls = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for t in range(tenants):
            # A per-minute window starts later on every call, as `now - 60` does.
            start = since if sliding_from is None else sliding_from + calls * 1e-6
            ledger.spent(f"tenant{t}", start)
            calls += 1
    return calls / seconds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--burst", type=int, default=50, help="record() calls between two turns of the loop")
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--spent-seconds", type=float, default=2.0)
    parser.add_argument("--paced-rate", type=float, default=5000.0, help="rows/s of the steady run (a2)")
    parser.add_argument("--paced-seconds", type=float, default=3.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        ledger = SqliteLedger(Path(tmp) / "usage.sqlite3")
        try:
            start_time = 1_767_225_600.0
            # The probe alone first, as long as the run below: how late this machine wakes the loop
            # anyway (other processes on its cores), beside how late it wakes it with the ledger busy.
            stop = asyncio.Event()
            idle_ms: list[float] = []
            probing = asyncio.create_task(probe(stop, idle_ms))
            await asyncio.sleep(1.0)
            stop.set()
            await probing

            stop = asyncio.Event()
            lags_ms: list[float] = []
            probing = asyncio.create_task(probe(stop, lags_ms))
            await asyncio.sleep(0.05)     # the probe's first wake-ups, before any row
            seconds, longest = await record_all(ledger, args.rows, args.tenants, start_time, args.burst)
            stop.set()
            await probing

            rate = args.rows / seconds
            lag_max = max(lags_ms)
            print(f"(a) {args.rows} rows recorded from the loop in bursts of {args.burst}, "
                  f"{args.tenants} tenants, written and flushed in {seconds:.2f} s")
            print(f"    requests/s onto disk    {rate:10,.0f}   target >= {TARGET_ROWS_PER_S:,}   "
                  f"{'ok' if rate >= TARGET_ROWS_PER_S else 'MISSED'}")
            print(f"    loop lag p50/p99/max    {pct(lags_ms, 0.5):.3f} / {pct(lags_ms, 0.99):.3f} / {lag_max:.3f} ms"
                  f"   target max <= {TARGET_LAG_MS} ms   {'ok' if lag_max <= TARGET_LAG_MS else 'MISSED'}"
                  f"   ({len(lags_ms)} probes, mean {statistics.mean(lags_ms):.3f} ms)")
            print(f"    the same probe, idle    {pct(idle_ms, 0.5):.3f} / {pct(idle_ms, 0.99):.3f} / {max(idle_ms):.3f} ms"
                  f"   (1 s before the run, no ledger work: this machine's own noise)")
            print(f"    longest record() call   {longest * 1e6:10.1f} us")

            stop = asyncio.Event()
            paced_ms: list[float] = []
            probing = asyncio.create_task(probe(stop, paced_ms))
            paced, paced_longest = await record_paced(ledger, args.paced_rate, args.paced_seconds, args.tenants,
                                                      start_time + args.rows * 0.001)
            stop.set()
            await probing
            paced_max = max(paced_ms)
            print(f"(a2) {paced} rows at a steady {args.paced_rate:,.0f} rows/s for {args.paced_seconds} s, flushed")
            print(f"    loop lag p50/p99/max    {pct(paced_ms, 0.5):.3f} / {pct(paced_ms, 0.99):.3f} / {paced_max:.3f} ms"
                  f"   target max <= {TARGET_LAG_MS} ms   {'ok' if paced_max <= TARGET_LAG_MS else 'MISSED'}"
                  f"   ({len(paced_ms)} probes)")
            print(f"    longest record() call   {paced_longest * 1e6:10.1f} us")

            total = args.rows + paced
            end_time = start_time + total * 0.001
            budget = spent_rate(ledger, args.tenants, start_time, None, args.spent_seconds)
            window = spent_rate(ledger, args.tenants, 0.0, end_time - 60, args.spent_seconds)
            print(f"(b) spent() over {total} requests on disk ({total // args.tenants} per tenant)")
            print(f"    a budget's period (same start, sum kept)       {budget:10,.0f} calls/s")
            print(f"    a per-minute window (new start every call)     {window:10,.0f} calls/s")
            for t in range(args.tenants):
                ledger.record(row(t, args.tenants, end_time))
            queued = spent_rate(ledger, args.tenants, start_time, None, args.spent_seconds)
            print(f"    a budget's period, with rows still queued      {queued:10,.0f} calls/s")
        finally:
            ledger.close()


if __name__ == "__main__":
    asyncio.run(main())
