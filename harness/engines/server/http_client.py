"""HTTP client of one sglang server or router: every call has a timeout, every failure names the URL.

Thin over ``requests``: :class:`ServerClient` methods map one-to-one to the endpoints the suites use
(``/generate``, ``/health``, ``/server_info``, ``/v1/loads``, ``/metrics`` (servers started with
``--enable-metrics``), ``/flush_cache``, ``/abort_request``, ``/health_generate``, router ``/workers``).
A non-2xx answer raises :class:`ServerHTTPError` carrying the status and the start of the body, so a
failing test shows what the server said.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import requests

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
GENERATE_TIMEOUT_S = 120.0


class ServerHTTPError(RuntimeError):
    """The server answered with a non-2xx status."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} answered HTTP {status}: {body[:300]}")
        self.url = url
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Generation:
    """One greedy generation: the output token ids, text, and sglang's ``meta_info``."""

    output_ids: tuple[int, ...]
    text: str
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ServerClient:
    """Client of one server (or router) at ``base_url`` (``http://host:port``)."""

    base_url: str
    timeout_s: float = DEFAULT_TIMEOUT_S

    def _url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def _request(self, method: str, path: str, timeout_s: float | None = None, **kwargs: Any) -> requests.Response:
        url = self._url(path)
        resp = requests.request(method, url, timeout=timeout_s or self.timeout_s, **kwargs)
        if not resp.ok:
            raise ServerHTTPError(url, resp.status_code, resp.text)
        return resp

    def health(self, timeout_s: float | None = None) -> bool:
        """True when ``/health`` answers 200; False on a refused connection, timeout or other status."""
        try:
            return requests.get(self._url("/health"), timeout=timeout_s or self.timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 8,
        *,
        ignore_eos: bool = True,
        timeout_s: float = GENERATE_TIMEOUT_S,
        extra: dict | None = None,
    ) -> Generation:
        """Greedy generation (temperature 0) from text or token ids.

        Args:
            prompt: text, or a list of token ids (sent as ``input_ids``).
            max_new_tokens: tokens to generate.
            ignore_eos: keep generating past EOS, so lengths are fixed and outputs comparable.
            timeout_s: request timeout.
            extra: more top-level request fields (e.g. ``rid``).

        Returns:
            The :class:`Generation`.

        Raises:
            ServerHTTPError: non-2xx answer.
            requests.RequestException: connection failure or timeout.
        """
        body: dict[str, Any] = {
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos},
        }
        if isinstance(prompt, str):
            body["text"] = prompt
        else:
            body["input_ids"] = [int(t) for t in prompt]
        body.update(extra or {})
        out = self._request("POST", "/generate", timeout_s, json=body).json()
        meta = out.get("meta_info", {})
        ids = out.get("output_ids")
        if ids is None:
            ids = meta.get("output_ids", [])
        return Generation(output_ids=tuple(int(t) for t in ids), text=out.get("text", ""), meta=meta)

    def server_info(self) -> dict:
        """``/server_info`` (sglang 0.5.23; older servers call it ``/get_server_info``)."""
        try:
            return self._request("GET", "/server_info").json()
        except ServerHTTPError as e:
            if e.status != 404:
                raise
            return self._request("GET", "/get_server_info").json()

    def metrics(self) -> dict[str, float]:
        """Prometheus ``/metrics`` as ``{"name{labels}": value}`` (comment lines dropped)."""
        out: dict[str, float] = {}
        for line in self._request("GET", "/metrics").text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out

    def loads(self) -> list[dict]:
        """``/v1/loads``: per DP rank, running/waiting requests and used/total KV tokens."""
        return list(self._request("GET", "/v1/loads").json().get("loads", []))

    def flush_cache(self, timeout_s: float | None = None) -> None:
        """``/flush_cache``: drop the radix cache (only succeeds when the server is idle)."""
        self._request("POST", "/flush_cache", timeout_s=timeout_s)

    def abort(self, rid: str) -> None:
        """``/abort_request``: abort request ``rid`` wherever it is in this server (queued, in
        transfer, decoding); sglang answers 200 whether or not it still knew the request (one it no
        longer knows is not aborted). While ``rid`` is live, sglang aborts every request whose rid
        starts with it: give rids none of which is a prefix of another (e.g.
        :func:`harness.engines.server.server_soak.server_rid`)."""
        self._request("POST", "/abort_request", json={"rid": rid})

    def abort_all(self) -> None:
        """``/abort_request`` with ``abort_all``: abort every request this server holds (0.5.18 ... 0.5.23
        take the field; an older server that does not aborts nothing and still answers)."""
        self._request("POST", "/abort_request", json={"rid": "", "abort_all": True})

    def health_generate(self, timeout_s: float | None = None) -> None:
        """``/health_generate``: sglang runs one real one-token request through its scheduler (on a PD
        server, with its fake bootstrap); raises :class:`ServerHTTPError` when it does not answer 200."""
        self._request("GET", "/health_generate", timeout_s=timeout_s)

    def add_worker(self, url: str, worker_type: str, bootstrap_port: int | None = None) -> None:
        """Router ``POST /workers``: register a server (``worker_type`` ``prefill`` or ``decode``; a
        prefill's bootstrap port); the router checks it and lists it in :meth:`workers` once healthy."""
        body: dict = {"url": url, "worker_type": worker_type}
        if bootstrap_port is not None:
            body["bootstrap_port"] = int(bootstrap_port)
        self._request("POST", "/workers", json=body)

    def remove_worker(self, url: str) -> bool:
        """Router ``DELETE /workers/{id}``: unregister the server at ``url`` (a replaced or dead one);
        False when the router lists no worker there."""
        for w in self.workers():
            if w.get("url") == url and w.get("id"):
                self._request("DELETE", f"/workers/{w['id']}")
                return True
        return False

    def workers(self) -> list[dict]:
        """Router ``/workers``: the registered workers (each a dict with url, type, health)."""
        data = self._request("GET", "/workers").json()
        return list(data.get("workers", data) if isinstance(data, dict) else data)
