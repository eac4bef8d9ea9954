"""Network calls with a bounded total time: the Hub's and the trackers' (W&B, MLflow).

Their libraries wait on a server that accepts a connection and never answers for as long as its socket lives (the Hub:
forever; MLflow: its read timeout times its retries, 20+ minutes), and retry a closed port for minutes. Each call here
runs in a daemon thread and is given up after its bound (TimedOut): the caller says so in one line and goes on; the
abandoned thread ends with the process. SPMDLM_NETWORK_TIMEOUT sets the bound of one call (seconds, default 60); an
upload also gets a second per MiB it sends (docs/tracking.md).
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from spmdlm.errors import ArgumentError

TIMEOUT_ENV = "SPMDLM_NETWORK_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
UPLOAD_BYTES_PER_S = 2**20  # an upload slower than this on average is taken as stuck


class TimedOut(Exception):
    """A network call that did not finish within its bound."""


def env_seconds(name: str, default: float, kind: type = float) -> float:
    """Seconds (at least 1) from the environment variable `name`, else `default`; a bad value is one line."""
    value = os.environ.get(name, "")
    try:
        seconds = kind(value) if value else default
    except ValueError:
        raise ArgumentError(f"{name}={value!r} is not a number of seconds") from None
    if not 1 <= seconds < float("inf"):
        raise ArgumentError(f"{name} must be at least 1 second, got {seconds}")
    return seconds


def timeout_s() -> float:
    return env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def bounded(call: Callable[[], Any], seconds: float | None = None) -> Any:
    """call()'s result, or its exception, if it ends within `seconds` (default: timeout_s()); else TimedOut."""
    seconds = timeout_s() if seconds is None else seconds
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread as it is
            outcome["error"] = e

    thread = threading.Thread(target=target, name="spmdlm-network", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimedOut(
            f"no answer within {seconds:g} s (the server is unreachable or not answering; {TIMEOUT_ENV} sets the bound)"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


PROXY_ENVS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def reachable(url: str, seconds: float = 3.0) -> bool:
    """Whether a TCP connection to `url`'s host and port opens within `seconds`, name lookup included (with a proxy
    in the environment: taken as yes, the connection would go through it)."""
    if any(os.environ.get(name) for name in PROXY_ENVS):
        return True
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return False
    if not host:
        return False

    def connect() -> None:
        socket.create_connection((host, port), timeout=seconds).close()

    try:
        bounded(connect, seconds)
    except (OSError, ValueError, TimedOut):
        return False
    return True
