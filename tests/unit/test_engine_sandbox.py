"""The engines' Landlock sandbox (sandbox.py) and the supervisor starting engines in it: what stays
readable, the real kernel hiding the peer TLS directory from a launched process (and keeping it
from tracing its parent), and the Required / BestEffort / Disabled modes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdfabric_agent.engines import sandbox
from pdfabric_agent.engines.launch import Timings, sandboxed_argv
from pdfabric_agent.engines.supervisor import EngineSupervisor
from pdfabric_agent.runtime import metrics
from pdfabric_core.engines.launch import EngineLaunch
from pdfabric_core.policy.types import Role
from pdfabric_core.spec import EngineSandbox
from pdfabric_devcluster.procs import free_port

ABI, WHY = sandbox.landlock_abi()
needs_landlock = pytest.mark.skipif(ABI < 1, reason=f"no Landlock here: {WHY}")
LAUNCHER = [sys.executable, "-I", os.path.abspath(sandbox.__file__)]
FAST = Timings(probe_s=0.05, liveness_s=0.3, backoff_s=0.1, backoff_max_s=0.4, grace_s=1.0)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    """secret/ (the hidden TLS directory, the kubelet's ..data layout), a sibling, and symlinks:
    into the secret, onto the way, and dangling."""
    secret = tmp_path / "pod" / "secret"
    data = secret / "..2026_12_01"
    data.mkdir(parents=True)
    (data / "tls.key").write_text("KEY")
    (secret / "..data").symlink_to(data.name)
    (secret / "tls.key").symlink_to("..data/tls.key")
    (tmp_path / "pod" / "token").write_text("TOKEN")
    (tmp_path / "pod" / "work").mkdir()
    (tmp_path / "pod" / "into-secret").symlink_to(secret / "tls.key")
    (tmp_path / "pod" / "onto-the-way").symlink_to(tmp_path)
    (tmp_path / "pod" / "dangling").symlink_to(tmp_path / "nowhere")
    yield tmp_path


def test_grants_are_the_siblings_on_the_way_and_never_what_leads_to_the_secret(tree: Path) -> None:
    pod = tree / "pod"
    got = dict(sandbox.grants([str(pod / "secret")]))
    assert got[str(pod / "token")] is False and got[str(pod / "work")] is True
    assert not any(sandbox._within(p, str(pod / "secret")) for p in got)  # neither it nor a link into it
    way = {"/", *(str(p) for p in pod.parents), str(pod)}
    assert not way & set(got)  # a grant on the way would cover the secret
    assert str(tree / "nowhere") not in got
    assert str(Path("/").resolve() / "usr") in got  # everything else stays readable
    assert sandbox.grants([str(tree / "missing")]) == []


@needs_landlock
def test_the_launcher_hides_the_secret_and_keeps_the_rest_readable(tree: Path) -> None:
    pod = tree / "pod"
    probe = textwrap.dedent(
        f"""
        import json, os, sys
        def can_read(path):
            try:
                open(path, "rb").read()
                return True
            except OSError:
                return False
        later = {str(pod / "work" / "later")!r}
        open(later, "w").write("x")
        print(json.dumps({{
            "key": can_read({str(pod / "secret" / "tls.key")!r}),
            "key-by-data": can_read({str(pod / "secret" / "..2026_12_01" / "tls.key")!r}),
            "key-by-link": can_read({str(pod / "into-secret")!r}),
            "key-by-proc-root": can_read("/proc/self/root" + {str(pod / "secret" / "tls.key")!r}),
            "names": sorted(os.listdir({str(pod / "secret")!r})),
            "token": can_read({str(pod / "token")!r}),
            "later": can_read(later),
            "stdlib": can_read(os.__file__),
        }}))
        """
    )
    out = subprocess.run(
        [*LAUNCHER, "--hide", str(pod / "secret"), "--required", "--", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(out.stdout)
    assert not (seen["key"] or seen["key-by-data"] or seen["key-by-link"] or seen["key-by-proc-root"]), seen
    assert seen["names"] == ["..2026_12_01", "..data", "tls.key"]  # names are not secrets; contents are
    assert seen["token"] and seen["later"] and seen["stdlib"], seen


PROC_FILES = ("environ", "mem", "maps", "fd/0")


def child_sees_parent(setup: str, launcher: list[str]) -> dict[str, str]:
    """What a child sees of its parent's /proc files ('read', or the error's name), the parent
    running without CAP_SYS_PTRACE, as in a pod that drops all capabilities (a root shell here keeps
    it): it runs `setup`, then starts the child through `launcher` (the argv before the child's)."""
    child = textwrap.dedent(
        f"""
        import sys
        for what in {PROC_FILES!r}:
            try:
                open(f"/proc/{{sys.argv[1]}}/" + what, "rb").read(1)
                print(what, "read")
            except OSError as exc:
                print(what, type(exc).__name__)
        """
    )
    parent = textwrap.dedent(setup) + textwrap.dedent(
        f"""
        import os, subprocess, sys
        out = subprocess.run({launcher!r} + [sys.executable, "-c", {child!r}, str(os.getpid())],
                             capture_output=True, text=True)
        print(out.stdout + out.stderr)
        """
    )
    out = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", sys.executable, "-c", parent],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


@needs_landlock
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop capabilities")
def test_a_sandboxed_process_cannot_read_its_parents_memory_or_environment(tree: Path) -> None:
    launcher = [*LAUNCHER, "--hide", str(tree / "pod" / "secret"), "--required", "--"]
    seen = child_sees_parent("", launcher)
    assert seen == dict.fromkeys(PROC_FILES, "PermissionError"), seen


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop capabilities")
@pytest.mark.parametrize("private", [True, False], ids=["non-dumpable", "dumpable"])
def test_a_non_dumpable_agent_keeps_its_proc_files_from_unsandboxed_children(private: bool) -> None:
    """Without Landlock (Disabled, or BestEffort on a kernel without it) an engine of the agent's
    user reads the agent's environ and maps, unless the agent made itself non-dumpable (as its
    main does)."""
    setup = f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("sandbox", {str(Path(sandbox.__file__))!r})
        sandbox = importlib.util.module_from_spec(spec); spec.loader.exec_module(sandbox)
        assert sandbox.keep_private() if {private!r} else True
        """
    seen = child_sees_parent(setup, [])
    if private:
        assert seen == dict.fromkeys(PROC_FILES, "PermissionError"), seen
    else:
        assert seen["environ"] == "read" and seen["maps"] == "read", seen


def test_the_check_fails_closed_when_a_hidden_file_is_readable(tree: Path) -> None:
    with pytest.raises(sandbox.SandboxError, match=r"tls\.key is still readable"):
        sandbox._check_hidden([str(tree / "pod" / "secret")])


def test_required_without_landlock_exits_before_running_anything(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (0, "this kernel has no Landlock"))
    ran = tree / "ran"
    code = sandbox.main(["--hide", str(tree / "pod" / "secret"), "--required", "--", "touch", str(ran)])
    assert code == sandbox.EXIT_UNAVAILABLE and not ran.exists()
    assert "required, but this kernel has no Landlock; not starting touch" in capsys.readouterr().err


def test_sandboxed_argv_by_mode() -> None:
    argv = ["python3", "-m", "sglang.launch_server"]
    assert sandboxed_argv("/py", ["/tls"], EngineSandbox.DISABLED, argv) == argv
    assert sandboxed_argv("/py", [], EngineSandbox.REQUIRED, argv) == argv
    # Wrapped only where Landlock was found: then a launcher that cannot apply it fails the run
    # in either mode, so an engine reported sandboxed always is.
    want = ["/py", "-I", os.path.abspath(sandbox.__file__), "--hide", "/tls", "--required", "--", *argv]
    assert sandboxed_argv("/py", ["/tls"], EngineSandbox.BEST_EFFORT, argv) == want
    assert sandboxed_argv("/py", ["/tls"], EngineSandbox.REQUIRED, argv) == want


# ------------------------------------------------------------------ the supervisor
# An engine that records what it could read, then serves /health.
ENGINE = """
import http.server, json, sys
port, dump, key, token = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def can_read(path):
    try:
        open(path).read()
        return True
    except OSError:
        return False
with open(dump, "w") as fh:
    json.dump({"key": can_read(key), "token": can_read(token), "argv": sys.argv}, fh)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def engine_supervisor(tree: Path, mode: EngineSandbox) -> tuple[EngineSupervisor, Path]:
    script, dump, port = tree / "engine.py", tree / "dump.json", free_port()
    script.write_text(ENGINE)
    pod = tree / "pod"
    argv = (
        sys.executable,
        str(script),
        "$(PDFABRIC_PORT)",
        str(dump),
        str(pod / "secret" / "tls.key"),
        str(pod / "token"),
    )
    x = EngineLaunch(
        name="prefill-0", role=Role.PREFILL, replica=0, rank_ids=("prefill-0-tp0-cp0",), gpus=(0,), argv=argv,
        env=(), port=port, bootstrap_port=port + 1, health_path="/health", startup_seconds=30, tp=1, pp=1, cp=1,
        cp_rank=0,
    )  # fmt: skip
    sup = EngineSupervisor(
        [x], cluster="sbx", agent_address="127.0.0.1:7400", token_file=str(pod / "token"), shm_dir="/dev/shm",
        timings=FAST, agent_env={"PATH": os.environ.get("PATH", os.defpath)}, stdout=io.StringIO(),
        stderr=io.StringIO(), sandbox_mode=mode, hidden=[str(pod / "secret")],
    )  # fmt: skip
    return sup, dump


def sandboxed_sample() -> float | None:
    return metrics.REGISTRY.get_sample_value("pdfabric_serving_engine_sandboxed", {"pdcluster": "sbx"})


async def serve_once(sup: EngineSupervisor) -> None:
    sup.start()
    try:
        for _ in range(250):
            if sup.ready:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"engine not ready: {sup.states()}")
    finally:
        await sup.stop()


@needs_landlock
@pytest.mark.parametrize("mode", [EngineSandbox.REQUIRED, EngineSandbox.BEST_EFFORT])
def test_supervised_engines_cannot_read_the_peer_key(tree: Path, mode: EngineSandbox) -> None:
    sup, dump = engine_supervisor(tree, mode)
    assert sup.sandboxed and sandboxed_sample() == 1
    assert sup.states()[0].sandboxed  # what /readyz and the PDCluster's status say
    asyncio.run(serve_once(sup))
    seen = json.loads(dump.read_text())
    assert seen == {"key": False, "token": True, "argv": seen["argv"]}
    assert seen["argv"][0].endswith("engine.py")  # the launcher exec'd the engine itself


def test_disabled_runs_the_engine_as_it_is(tree: Path) -> None:
    sup, dump = engine_supervisor(tree, EngineSandbox.DISABLED)
    assert not sup.sandboxed and sandboxed_sample() == 0 and not sup.states()[0].sandboxed
    asyncio.run(serve_once(sup))
    assert json.loads(dump.read_text())["key"] is True


def test_without_landlock_required_starts_nothing_and_best_effort_runs_unsandboxed(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: (0, "this kernel has no Landlock"))
    sup, dump = engine_supervisor(tree, EngineSandbox.REQUIRED)
    assert not sup.sandboxed and sandboxed_sample() == 0

    async def refused() -> None:
        sup.start()
        try:
            for _ in range(250):
                if sup.states()[0].restarts:
                    break
                await asyncio.sleep(0.02)
        finally:
            await sup.stop()

    asyncio.run(refused())
    state = sup.states()[0]
    assert state.last_exit == "spec.engine.sandbox is Required, but this kernel has no Landlock"
    assert not dump.exists()
    best, dump = engine_supervisor(tree, EngineSandbox.BEST_EFFORT)
    asyncio.run(serve_once(best))
    assert json.loads(dump.read_text())["key"] is True and sandboxed_sample() == 0
