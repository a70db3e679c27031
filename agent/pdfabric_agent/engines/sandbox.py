"""Engines run without the agent's peer credentials: a Landlock sandbox for the engine processes.

The engines the agent runs (spec.engine) share its container and its user, so file permissions
cannot keep them from the peer key: any engine, or anything that compromises one, could present
the node's peer identity to every other agent of the cluster. Landlock (Linux >= 5.13, allowed by
the container runtimes' default seccomp profiles, no privilege needed) lets a process give up
access for itself and everything it starts. The agent starts each engine through this module's
launcher, which gives up

- reading files beneath the hidden directories (the peer TLS directory: key, certificate, CA).
  Landlock grants by hierarchy, so the sandbox grants reading beneath every entry of every
  directory that leads to a hidden one, except the one that leads on: everything else stays
  readable, including what is created later inside those entries (/tmp, the venv, /dev, /proc).
  What is created later directly in a directory on the way (a new file in / or /etc) is not;
- ptrace of processes outside the sandbox (Landlock's own rule): an engine cannot ptrace the
  agent, nor read the /proc/<pid> files that need ptrace access (mem, environ, maps, fd).

The agent also makes itself non-dumpable at start (``keep_private``): its /proc/<pid> files then
belong to root, which keeps them from an engine that is not sandboxed (Disabled, or BestEffort
where the kernel has no Landlock) and from any other process of the agent's user, as long as that
process lacks CAP_SYS_PTRACE. What this does not hide: from root with its capabilities (a process
outside the sandbox in a container that keeps them, or a shell on the node) the agent's environ,
maps and memory stay readable; an adversarial run as root read them (issue 40). The node pods run
as a non-root user and drop every capability (the "restricted" Pod Security level), which is what
makes both rules hold there.

and then execs the engine. Listing a hidden directory's names stays possible (only file reads
are handled), and so does everything the engine contract needs (the engine token, the pools,
the agent's loopback door).

Modes (spec.engine.sandbox, core's EngineSandbox): Required refuses to start engines where the
kernel has no Landlock; BestEffort starts them unsandboxed there and says so (log,
pdfabric_serving_engine_sandboxed 0); Disabled runs them as they are.

    python -I .../pdfabric_agent/sandbox.py --hide DIR [--hide DIR ...] [--required] -- PROGRAM ARGS...

The launcher is this file run by path in isolated mode (-I: no PYTHON* variables, no user site),
standard library only, so an engine's own PYTHONPATH can neither break nor replace it.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import os
import platform
import struct
import sys
from collections.abc import Sequence

# <linux/landlock.h>; the syscall numbers are the generic table's (x86_64 and arm64 alike).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_ACCESS_FS_READ_FILE = 1 << 2
_PR_SET_NO_NEW_PRIVS = 38
_ARCHES = {"x86_64", "aarch64", "arm64"}

EXIT_UNAVAILABLE = 126  # the launcher's exit status when a required sandbox cannot be set up


_PR_SET_DUMPABLE = 4


def keep_private() -> bool:
    """Make this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``): processes of its user
    without CAP_SYS_PTRACE can no longer read its /proc/<pid>/environ, maps, mem or fd, nor
    ptrace it. Children get their own flag back when they exec. False where it did not take."""
    if sys.platform != "linux":
        return False
    return int(_libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0


class SandboxError(Exception):
    """The sandbox cannot be set up (no Landlock in this kernel, a rule refused) or did not hold."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> tuple[int, str]:
    """This kernel's Landlock ABI version (0 without Landlock) and, when 0, why."""
    if sys.platform != "linux" or platform.machine() not in _ARCHES:
        return 0, f"Landlock is Linux's (x86_64, arm64); this is {sys.platform} {platform.machine()}"
    libc = _libc()
    abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if abi >= 1:
        return int(abi), ""
    err = ctypes.get_errno()
    if err == errno.ENOSYS:
        why = "this kernel has no Landlock (Linux >= 5.13 built with CONFIG_SECURITY_LANDLOCK)"
    elif err == errno.EOPNOTSUPP:
        why = "Landlock is built but not enabled (add landlock to the kernel's lsm= boot parameter)"
    else:
        why = f"Landlock is not allowed here: {os.strerror(err)} (a seccomp profile that denies its syscalls?)"
    return 0, why


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def grants(hidden: Sequence[str]) -> list[tuple[str, bool]]:
    """What stays readable: (path, is_dir) for every entry of every directory on the way to a
    hidden directory, except the entries that lead to one, and except those that resolve into a
    hidden directory or onto the way (a symlink /x -> /etc would otherwise grant all of /etc).
    Hidden paths that do not exist hide nothing."""
    hide = sorted({os.path.realpath(h) for h in hidden if os.path.exists(h)})
    way: set[str] = set()
    for h in hide:
        parent = os.path.dirname(h)
        while True:
            way.add(parent)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
    out: dict[str, bool] = {}
    for directory in sorted(way):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            entry = os.path.join(directory, name)
            real = os.path.realpath(entry)
            if real in way or any(_within(real, h) for h in hide) or not os.path.exists(real):
                continue
            out[real] = os.path.isdir(real)
    return sorted(out.items())


def restrict(hidden: Sequence[str]) -> int:
    """Give up reading beneath `hidden` (and ptrace outside the sandbox) for this process and all
    it starts; the Landlock ABI used. Raises SandboxError when that cannot be done, and when a
    hidden file is still readable afterwards."""
    abi, why = landlock_abi()
    if abi < 1:
        raise SandboxError(why)
    libc = _libc()
    attr = struct.pack("=Q", _ACCESS_FS_READ_FILE)  # landlock_ruleset_attr.handled_access_fs
    ruleset = libc.syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise SandboxError(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path, _is_dir in grants(hidden):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since it was listed
            try:
                rule = struct.pack("=Qi", _ACCESS_FS_READ_FILE, fd)  # landlock_path_beneath_attr (packed)
                if libc.syscall(_SYS_ADD_RULE, ruleset, ctypes.c_int(_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)):
                    raise SandboxError(f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise SandboxError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)):
            raise SandboxError(f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    _check_hidden(hidden)
    return abi


def _check_hidden(hidden: Sequence[str]) -> None:
    """Fail closed: a regular file beneath a hidden directory that can still be read."""
    for h in hidden:
        for root, _dirs, files in os.walk(h, followlinks=False):
            for name in files:
                path = os.path.join(root, name)
                if not os.path.isfile(path):
                    continue
                try:
                    with open(path, "rb"):
                        pass
                except OSError:  # PermissionError: hidden, as it should be
                    continue
                raise SandboxError(f"{path} is still readable inside the sandbox")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdfabric_agent.engines.sandbox", description=__doc__.split("\n")[0])
    parser.add_argument("--hide", action="append", default=[], help="a directory whose files the command may not read")
    parser.add_argument("--required", action="store_true", help="refuse to run the command unsandboxed")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (after --)")
    try:
        restrict(args.hide)
    except SandboxError as exc:
        if args.required:
            print(f"pdfabric sandbox: required, but {exc}; not starting {command[0]}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"pdfabric sandbox: {exc}; starting {command[0]} without it", file=sys.stderr)
    try:
        os.execvp(command[0], command)  # replaces this process: returns only by raising
    except OSError as exc:
        print(f"pdfabric sandbox: cannot start {command[0]}: {exc.strerror or exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
