"""The fork server's client: what Ray runs as a worker's ``py_executable`` (stdlib only, run by path).

It hands its argv, environment, working directory and stdio to the fork server named by
``$HARNESS_FORKSERVER``, whose forked child becomes the Ray worker, and stays as the child's stand-in for the
raylet (signals forwarded, the child's exit status returned). A client whose environment differs from the
server's runs its command as a fresh interpreter instead. It imports only the standard library, so it costs
a few milliseconds. Detail (environment matching, sessions): docs/modules.md.
"""

import json
import os
import signal
import socket
import sys

ENV = "HARNESS_FORKSERVER"
MATCH_FILE = "match.json"


def differing(path: str, environ=None) -> list:
    """Env vars the server at socket ``path`` needs equal whose values in ``environ`` (default: this
    process's) differ from the server's (none named: [])."""
    environ = os.environ if environ is None else environ
    try:
        with open(os.path.join(os.path.dirname(path), MATCH_FILE)) as f:
            must = json.load(f)
    except FileNotFoundError:
        return []
    ignore, preset = set(must.get("ignore", ())), must.get("set_by_preload", {})
    out = {k for k, v in must.get("env", {}).items() if environ.get(k, "") != v}
    for prefix, theirs in must.get("prefixes", {}).items():
        mine = {k: v for k, v in environ.items() if k.startswith(prefix) and k not in ignore}
        out |= {k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)}
    free = must.get("free_path")
    if free is not None and "PYTHONPATH" in out and not _shadows(environ.get("PYTHONPATH", ""), free):
        out.discard("PYTHONPATH")  # the child rebuilds sys.path from its own; nothing it has is shadowed
    # A value the preload's imports set themselves is where the server's environment ended up too.
    return sorted(k for k in out if k not in preset or environ.get(k) != preset[k])


def _shadows(pythonpath, free):
    """Whether a directory on ``pythonpath`` that the server's ``PYTHONPATH`` lacks holds a top-level
    module or package the server's preload imported (a fresh interpreter would import that copy)."""
    theirs = {os.path.abspath(p) for p in free.get("pythonpath", "").split(os.pathsep) if p}
    tops = set(free.get("tops", ()))
    for entry in pythonpath.split(os.pathsep):
        if not entry or os.path.abspath(entry) in theirs:
            continue
        try:
            names = os.listdir(entry)
        except OSError:
            continue  # a missing directory imports nothing
        if any(name.partition(".")[0] in tops for name in names):
            return True
    return False


def autogroup_nice(tries: int = 20) -> None:
    """Give this session's scheduling group this process's priority. With the kernel's autogroups
    (``/proc/sys/kernel/sched_autogroup_enabled``) each session is scheduled as one group of equal
    weight whatever its processes' nice values: a niced caller's command in a session of its own
    would otherwise take a whole share beside everything else (the fault check beside the tests).
    Without CAP_SYS_ADMIN the kernel takes one such change per 100 ms machine-wide (EAGAIN): tried
    again, ``tries`` times at most."""
    import errno
    import time

    nice = os.nice(0)
    if nice <= 0:
        return
    for _ in range(tries):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return
        except OSError as e:
            if e.errno != errno.EAGAIN:
                return  # no autogroups here: the process's own nice value is what counts
            time.sleep(0.02)


def fresh(session: bool) -> None:
    """Run the command as a fresh interpreter, in this process (never returns)."""
    if session:
        autogroup_nice()  # as the fork server's child would have
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def main() -> int:
    path = os.environ.get(ENV)
    if not path:
        print(f"forkserver client: ${ENV} is not set; run workers through harness.workers.forkserver", file=sys.stderr)
        return 2
    session = os.getsid(0) == os.getpid()
    differ = differing(path)
    if differ:
        print(
            f"forkserver client: {', '.join(differ)} differ from the fork server's; starting a fresh interpreter",
            file=sys.stderr,
            flush=True,
        )
        fresh(session)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        print(
            f"forkserver client: cannot reach the fork server at {path} ({e}); starting a fresh interpreter",
            file=sys.stderr,
            flush=True,
        )
        fresh(session)
    sigint_ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    payload = json.dumps(
        {
            "argv": sys.argv[1:],
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "nice": os.nice(0),
            "session": session,
            "group": os.getpgid(0) == os.getpid(),
            "sigint_ignored": sigint_ignored,
        }
    ).encode()
    socket.send_fds(sock, [len(payload).to_bytes(8, "big") + payload], [0, 1, 2])
    child: list = []

    def forward(signum, _frame):
        if not child:
            return
        try:
            if session:  # the child leads its own session (as this process does): signal its group
                os.killpg(child[0], signum)
                return
        except (ProcessLookupError, PermissionError):
            pass  # not yet its own group leader
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    buf = b""
    while True:
        try:
            data = sock.recv(4096)
        except InterruptedError:
            continue
        if not data:
            if not child:  # never forked (the server could not, or is gone): run it here instead
                print(
                    "forkserver client: the fork server did not start the command; starting a fresh interpreter",
                    file=sys.stderr,
                    flush=True,
                )
                sock.close()
                fresh(session)
            print("forkserver client: the fork server went away", file=sys.stderr)
            return 1
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            word, value = line.decode().split()
            if word == "pid":
                child.append(int(value))
            elif word == "exit":
                code = int(value)
                if code < 0:  # mirror a death by signal (SIGKILL and SIGSTOP take no handler)
                    if -code not in (signal.SIGKILL, signal.SIGSTOP):
                        signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                return code


if __name__ == "__main__":
    sys.exit(main())
