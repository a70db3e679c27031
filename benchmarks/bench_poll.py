"""What one scheduler iteration costs an engine rank in polls, with 64 and 256 rooms in flight:
asking the agent about each room (``AgentClient.poll``, one HTTP request per room, as the SGLang
plugin did on every iteration) against reading the table the agent's room feed keeps
(``RoomEvents.view``, what the plugin does now while the feed is up).

Run: ``python benchmarks/bench_poll.py [--repeat 20]`` (real agents on loopback tcp). The rooms
are decode rooms announced and not sent, and prefill rooms decode announced (WaitingForInput at
the prefill rank), so every poll finds a live room. Medians over ``--repeat`` iterations. Two
cores are shared by everything here: read the ratio, not the microseconds.

Not measured here: SGLang's Mooncake backend under the same SGLang queues (issue 23 asks for
that comparison; its poll is a dictionary lookup too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, p) for p in ("core", "operator", "agent", "hack")]
os.environ.setdefault("MC_FORCE_TCP", "1")

from pdfabric_agent.client.feed import RoomEvents  # noqa: E402
from pdfabric_devcluster.fabric import LocalFabric  # noqa: E402

SPEC = {
    "prefill": {"tp": 1},
    "decode": {"tp": 1},
    "transfer": {"transport": "tcp", "timeoutSeconds": 600},
    "model": {"layers": 2, "kvHeads": 2, "headDim": 16, "pageSizeTokens": 4, "auxRowBytes": [16]},
}
P, D = "prefill-0-tp0-cp0", "decode-0-tp0"


def iteration_s(poll: object, rooms: list[int], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for room in rooms:
            poll(room)  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    rows = []
    with LocalFabric(SPEC, env={"PDFABRIC_BOOTSTRAP_TIMEOUT_S": "600", "PDFABRIC_KV_PAGES": "512"}) as lc:
        feeds = {r: RoomEvents(lc.agents[lc.agent_of(r)].address, lc.token, r).start(wait_s=10) for r in (P, D)}
        made = 0
        for n in (64, 256):
            for room in range(made, n):
                feeds[D].put(
                    lc.client(D).receive(D, room, [room % lc.kv_pages])
                )  # as the plugin puts a submit's answer
            made = n
            rooms = list(range(n))
            deadline = time.monotonic() + 30
            while not all(feeds[P].view(r) for r in rooms) and time.monotonic() < deadline:
                time.sleep(0.05)
            for rank in (P, D):
                client = lc.client(rank)
                http = iteration_s(lambda r, c=client, k=rank: c.poll(k, r), rooms, args.repeat)
                table = iteration_s(feeds[rank].view, rooms, args.repeat)
                # What an engine acts on agrees (between a submit and its end the table keeps the
                # submit's answer: a decode room's Bootstrapping -> WaitingForInput is not pushed).
                said = [(v.finished, v.decode_ranks_ready) for v in (client.poll(rank, r) for r in rooms)]
                kept = [(v.finished, v.decode_ranks_ready) for v in (feeds[rank].view(r) for r in rooms) if v]
                if kept != said:
                    raise RuntimeError(f"{rank}: the feed's table disagrees with the agent's answers")
                rows.append((n, rank, http, table))
        for events in feeds.values():
            events.close()
    print(f"{'rooms':>5}  {'rank':<18} {'HTTP poll / iter':>16} {'feed table / iter':>17} {'ratio':>8}")
    for n, rank, http, table in rows:
        print(f"{n:>5}  {rank:<18} {http * 1e3:>13.2f} ms {table * 1e6:>14.1f} us {http / table:>7.0f}x")


if __name__ == "__main__":
    main()
