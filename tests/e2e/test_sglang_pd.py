"""SGLang's own classes move a real model's KV through real agents (issue 11).

The pdfabric distribution is installed (its ``sglang.srt.plugins`` entry point with it), SGLang's
``load_plugins()`` loads the plugin in each engine process, SGLang's ``get_kv_class`` returns the
pdfabric classes, and the reference engine drives them as SGLang's schedulers do: prefill computes
the prompts' KV into its own shared-memory pools in SGLang's page layout, the agents move it over
the Mooncake engine (tcp), decode generates from its pools alone. Greedy generation through PD
must equal colocated generation token for token.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdfabric_devcluster.fabric import LocalFabric
from tests.e2e.pd_runs import PROMPTS, REF_MODEL, colocated, run_pd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [({"tp": 1}, {"tp": 1}), ({"tp": 2}, {"tp": 4}), ({"tp": 1, "cp": 2}, {"tp": 1})],
    ids=["tp1-tp1", "tp2-tp4-head-slices", "prefill-cp2"],
)
def test_greedy_generation_through_pd_equals_colocated(
    installed_site: Path, tmp_path: Path, prefill: dict[str, int], decode: dict[str, int]
) -> None:
    p = {**prefill, **({"allCpRanksTransfer": True} if prefill.get("cp", 1) > 1 else {})}
    spec = {"prefill": p, "decode": decode, "transfer": {"transport": "tcp", "timeoutSeconds": 20}, "model": REF_MODEL}
    with LocalFabric(spec) as lc:
        out = run_pd(lc, installed_site, tmp_path, prefill, decode)
        # SGLang's get_kv_class answered with the plugin's classes.
        assert out["decode"]["classes"]["RECEIVER"] == "pdfabric_sglang.receiver.PdfabricKVReceiver"
        assert out["prefill"]["classes"]["SENDER"] == "pdfabric_sglang.sender.PdfabricKVSender"
        for side in ("prefill", "decode"):
            assert [r["state"] for r in out[side]["results"]] == ["Success"] * len(PROMPTS), out[side]
        assert [r["tokens"] for r in out["decode"]["results"]] == colocated()
        # SGLang's KVTransferMetric: the bytes each decode rank's agent counted, and a latency.
        moved = sum(
            lc.metric_sum("pdfabric_transfer_bytes_total", role="decode", kind=k) for k in ("kv", "state", "aux")
        )
        reported = sum(m["bytes"] for r in out["decode"]["results"] for m in r["metrics"].values())
        assert reported == moved > 0
        assert all(m["latency_s"] > 0 for r in out["prefill"]["results"] for m in r["metrics"].values())


def test_an_engine_without_sglang_attaches_through_the_engine_api(installed_site: Path, tmp_path: Path) -> None:
    """The same engine on the agent's engine API alone (``--backend direct``): how an engine other
    than SGLang, or SGLang without its GPU kernels, moves its own buffers; head slices TP 2 -> 4."""
    spec = {"prefill": {"tp": 2}, "decode": {"tp": 4}, "transfer": {"transport": "tcp"}, "model": REF_MODEL}
    with LocalFabric(spec) as lc:
        out = run_pd(lc, installed_site, tmp_path, {"tp": 2}, {"tp": 4}, backend="direct")
        assert [r["state"] for r in out["decode"]["results"]] == ["Success"] * len(PROMPTS), out["decode"]
        assert [r["tokens"] for r in out["decode"]["results"]] == colocated()


def test_bad_registration_and_aborted_room_reach_sglang_as_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The classes in this process, against real agents: a pool that does not fit the PDCluster's
    model is refused with the mismatch named; an aborted room is Failed with a KVTransferError."""
    import numpy as np
    from pdfabric_refengine import KVPool, kv_args
    from pdfabric_sglang.conn import PdfabricKVBootstrapServer, PdfabricKVManager, PdfabricKVReceiver
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.utils import DisaggregationMode

    spec = {"prefill": {"tp": 1}, "decode": {"tp": 1}, "transfer": {"transport": "tcp"}, "model": REF_MODEL}
    with LocalFabric(spec) as lc:
        (tmp_path / "token").write_text(lc.token)
        monkeypatch.setenv("PDFABRIC_ENGINE_TOKEN_FILE", str(tmp_path / "token"))
        monkeypatch.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of("decode-0-tp0")].address)
        wrong = KVPool(layers=2, local_heads=4, head_dim=8, num_pages=8, shm_dir=lc.shm_dir)  # head dim 8, not 16
        right = KVPool(layers=2, local_heads=4, head_dim=16, num_pages=8, shm_dir=lc.shm_dir)
        try:
            with pytest.raises(RuntimeError, match="KV bytes per page registered; decode-0-tp0"):
                PdfabricKVManager(kv_args(wrong, engine_rank=0, page_size=16, kv_head_num=4, total_kv_head_num=4),
                                  DisaggregationMode.DECODE, None, False)  # fmt: skip
            mgr = PdfabricKVManager(
                kv_args(right, engine_rank=0, page_size=16, kv_head_num=4, total_kv_head_num=4),
                DisaggregationMode.DECODE, None, False,
            )  # fmt: skip
            monkeypatch.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of("prefill-0-tp0-cp0")].address)
            server = PdfabricKVBootstrapServer("127.0.0.1", 0)
            try:
                receiver = PdfabricKVReceiver(mgr, f"127.0.0.1:{server.port}", 77)
                receiver.init(0)  # the prefill's replica is looked up off this thread: Bootstrapping until known
                deadline = time.monotonic() + 10
                while (state := receiver.poll()) == KVPoll.Bootstrapping and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert state == KVPoll.WaitingForInput
                receiver.send_metadata(np.asarray([0, 1], dtype=np.int32), 0, None)
                # The submit went on the rank's worker thread (the scheduler does not wait for it).
                assert mgr.calls.wait_idle(5)
                assert receiver.poll() == KVPoll.WaitingForInput  # submitted; prefill has not sent
                # An engine restart registers again: it waits while a room would land in the old
                # buffers, and is refused once its bootstrap timeout passed with the room still open.
                # The old engine exited: its room feed closed (while it is open, the rank is its:
                # rank_taken, docs/sglang.md "DP groups"); its room stays open at the agent.
                mgr.events.close()
                monkeypatch.setenv("PDFABRIC_AGENT_ADDRESS", lc.agents[lc.agent_of("decode-0-tp0")].address)
                monkeypatch.setenv("PDFABRIC_BOOTSTRAP_TIMEOUT_S", "2")
                again = kv_args(right, engine_rank=0, page_size=16, kv_head_num=4, total_kv_head_num=4)
                with pytest.raises(RuntimeError, match="decode-0-tp0 has 1 open rooms"):
                    PdfabricKVManager(again, DisaggregationMode.DECODE, None, False)
                receiver.abort()
                assert mgr.calls.wait_idle(5)  # the abort reaches the agent on the rank's worker thread
                assert receiver.poll() == KVPoll.Failed
                with pytest.raises(KVTransferError, match="aborted by SGLang"):
                    receiver.failure_exception()
                view = lc.client("decode-0-tp0").poll("decode-0-tp0", 77)
                assert (view.state.title, view.reason) == ("Failed", "aborted by SGLang")
                # Once no room is open, the new registration replaces the old one.
                PdfabricKVManager(again, DisaggregationMode.DECODE, None, False)
                memory = lc.client("decode-0-tp0").info().rank("decode-0-tp0").engine_memory
                assert memory is not None and memory.buffers == 2 * 2 + 3 and memory.devices == ("cpu",)
            finally:
                server.close()
                mgr.close()
        finally:
            wrong.close()
            right.close()
