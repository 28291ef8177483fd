"""The watcher beside each real-server test (``harness.plugins.servers._StackWatcher``): when the watchdog
reports a stack's worker dead, every request on the stack's surviving servers is aborted at once, so a
client blocked on the dead one returns now. Stand-in servers record what reaches their ``/abort_request``
(a real stack's death costs a restart; the fault check's runs show it on real servers: a decode killed by
sglang's own memory check while prefill waited out its 300 s bootstrap timeout)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from harness.clock import wait_for
from harness.engines.server.pd_stack import PdStack
from harness.plugins.servers import _StackWatcher
from harness.workers import WorkerDied


class StandIn:
    """One server's HTTP face: records the body of each ``/abort_request``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.aborts: list[dict] = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/abort_request":
                    stand_in.aborts.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Pool:
    """What the watcher reads of a :class:`~harness.engines.server.stack_pool.StackPool`."""

    run_dir = None

    def __init__(self, *stacks: PdStack) -> None:
        self._stacks = list(stacks)

    def pd_stacks(self) -> list[PdStack]:
        return list(self._stacks)


@pytest.fixture
def stack():
    servers = [StandIn(n) for n in ("prefill-3", "decode-3", "router-3")]
    yield PdStack(*servers, model="m")  # type: ignore[arg-type]
    for s in servers:
        s.close()


def test_a_dead_decode_aborts_every_request_on_prefill_and_no_other_death_does(stack):
    deaths: list[WorkerDied] = []
    watcher = _StackWatcher(Pool(stack), deaths)  # type: ignore[arg-type]
    try:
        deaths.append(WorkerDied("decode-9", "exit code 1", "", None))  # another stack's worker
        deaths.append(WorkerDied("decode-3", "exit code 1", "", None))
        wait_for(lambda: stack.prefill.aborts, 30, "prefill's abort_all")
    finally:
        watcher.stop()
    assert stack.prefill.aborts == [{"rid": "", "abort_all": True}]
    assert stack.decode.aborts == []  # dead: nothing to ask it


def test_deaths_before_the_test_are_not_its_business(stack):
    deaths = [WorkerDied("decode-3", "exit code 1", "", None)]
    watcher = _StackWatcher(Pool(stack), deaths)  # type: ignore[arg-type]
    try:
        deaths.append(WorkerDied("prefill-3", "exit code 1", "", None))
        wait_for(lambda: stack.decode.aborts, 30, "decode's abort_all")
    finally:
        watcher.stop()
    assert stack.prefill.aborts == []
    assert stack.decode.aborts == [{"rid": "", "abort_all": True}]
