"""The time vLLM's decode server takes to its first token once prefill has answered, with
pdfabric's connector and with vLLM's own NixlConnector (the baseline), measured the same way in
one run: prefill TP 1 -> decode TP 1, the router's two steps taken by hand (prefill with
``do_remote_decode`` and one token; then decode with prefill's ``kv_transfer_params`` and one
token), the clock running from prefill's answer to decode's. What it holds is the KV's transfer
and decode's one step: the time PD exposes after prefill. Then what the pair costs idle: the CPU
seconds per second both servers' processes (and pdfabric's agents) use over 10 s without requests.

Run: ``python benchmarks/bench_vllm_exposed.py [--requests 10] [--tokens 300]`` (real vLLM servers
of the CPU build, real agents on loopback tcp for pdfabric; a few minutes). The connectors run one
after the other, each pair alone on the machine. Two cores: read the ratio, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / p) for p in ("core", "operator", "agent", "hack")]

from pdfabric_sglangserver.model import write_model_dir  # noqa: E402
from pdfabric_vllmserver.pd import CONNECTORS, pair  # noqa: E402
from pdfabric_vllmserver.servers import MODEL, completion, vllm_python  # noqa: E402


def _cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _tree(roots: set[int]) -> set[int]:
    """The processes under ``roots`` (a server's engine core and workers), the roots included."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found = set(roots)
    while grown := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= grown
    return found


def idle_cores(roots: set[int], seconds: float = 10.0) -> float:
    time.sleep(2)  # what the last request left running settles
    pids = _tree(roots)
    before = _cpu_seconds(pids)
    time.sleep(seconds)
    return (_cpu_seconds(pids) - before) / seconds


def exposed(
    connector: str, python: str, model_dir: Path, logs: Path, requests: int, tokens: int
) -> tuple[list[float], float]:
    samples = []
    with pair(connector, python, model_dir, logs) as (prefill, decode, fabric):
        for i in range(requests + 1):  # the first warms both servers' paths, and is dropped
            prompt = [(i * 31 + j * 7) % 250 + 1 for j in range(tokens)]
            status, first = prefill.complete(completion(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
            if status != 200:
                raise RuntimeError(f"{connector} prefill answered {status}: {first}")
            started = time.monotonic()
            status, got = decode.complete(completion(prompt, 1, kv_transfer_params=first["kv_transfer_params"]))
            elapsed = time.monotonic() - started
            if status != 200:
                raise RuntimeError(f"{connector} decode answered {status}: {got}")
            if i:
                samples.append(elapsed)
            time.sleep(0.2)  # one request at a time, each on idle servers
        roots = {prefill.proc.pid, decode.proc.pid}
        if fabric is not None:
            roots |= {agent.proc.pid for agent in fabric.agents.values() if agent.proc is not None}
        return samples, idle_cores(roots)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    python = vllm_python()
    results: dict[str, list[float]] = {}
    idle: dict[str, float] = {}
    work = ROOT / ".artifacts" / "bench-vllm-exposed"  # the servers' logs stay for a look
    shutil.rmtree(work, ignore_errors=True)
    model_dir = write_model_dir(work / "model", MODEL)
    for connector in CONNECTORS:
        logs = work / connector
        logs.mkdir(parents=True)
        results[connector], idle[connector] = exposed(connector, python, model_dir, logs, args.requests, args.tokens)
    base = statistics.median(results["nixl"])
    print(f"\ndecode's first token after prefill answered: {args.tokens}-token prompts, TP 1 -> 1, "
          f"{args.requests} requests each ({os.cpu_count()} cores)\n")  # fmt: skip
    print("| connector | median ms | p90 ms | max ms | median / NixlConnector's | idle cores |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for connector, samples in results.items():
        ordered = sorted(samples)
        p90 = ordered[max(0, -(-len(ordered) * 9 // 10) - 1)]
        median = statistics.median(samples)
        print(
            f"| {connector} | {median * 1e3:.0f} | {p90 * 1e3:.0f} | {ordered[-1] * 1e3:.0f} | {median / base:.2f} "
            f"| {idle[connector]:.2f} |"
        )
    for connector, samples in results.items():
        print(f"{connector}: " + ", ".join(f"{s * 1e3:.0f}" for s in samples) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
