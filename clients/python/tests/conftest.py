"""One real ``engram up`` for the whole session: the binary at ``$ENGRAM_BIN`` or the
repository's ``target/debug/engram``, a temp ``--home``, free ports for NATS and HTTP
(``0``: the ready line says which), and API keys issued with ``engram key add``, as the
Rust tests in services/engram/tests/up.rs do. Everything is stopped with SIGTERM at the
end (killed if it does not stop)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
READY_TIMEOUT = 180.0
TENANT = "acme"


def engram_bin() -> Path:
    path = Path(os.environ.get("ENGRAM_BIN") or REPO / "target" / "debug" / "engram")
    if not path.exists():
        pytest.exit(f"no engram binary at {path}: run `cargo build -p engram` (or set ENGRAM_BIN)", returncode=2)
    return path


@dataclass
class Server:
    bin: Path
    home: Path
    nats: str
    http: str
    log: Path

    def cli(self, *args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("ENGRAM_CONFIG", "ENGRAM_CREDS", "ENGRAM_HOME")}
        out = subprocess.run(
            [str(self.bin), "--home", str(self.home), "--nats", self.nats, *args],
            env=env, capture_output=True, text=True, timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"engram {' '.join(args)}: {out.stderr}")
        return out.stdout

    def key(self, tenant: str, agent: str, *scopes: str) -> str:
        """A new API key, once the server has taken it (a config reload after issuing)."""
        args = ["--json", "key", "add", "--tenant", tenant, "--agent", agent]
        for scope in scopes:
            args += ["--scope", scope]
        api_key = json.loads(self.cli(*args))["api_key"]
        deadline = time.monotonic() + 30
        while True:
            r = httpx.get(f"{self.http}/v1/whoami", headers={"authorization": f"Bearer {api_key}"}, timeout=10)
            if r.status_code == 200:
                return str(api_key)
            assert r.status_code == 401, r.text
            assert time.monotonic() < deadline, "the key never worked"
            time.sleep(0.05)


def _lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    binary = engram_bin()
    home = tmp_path_factory.mktemp("engram-home")
    log = home / "up.log"
    env = {k: v for k, v in os.environ.items() if k not in ("ENGRAM_CONFIG", "ENGRAM_CREDS", "ENGRAM_HOME")}
    with open(log, "w") as stderr:
        child = subprocess.Popen(
            [str(binary), "up", "--home", str(home), "--nats-port", "0", "--http", "127.0.0.1:0"],
            env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(child.stdout, lines), daemon=True).start()
    ready = None
    deadline = time.monotonic() + READY_TIMEOUT
    while ready is None:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line and "engram is up" in line:
            ready = line
        elif line is None or child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.exit(f"engram up did not start; its log:\n{log.read_text()[-4000:]}", returncode=2)
    tokens = dict(t.split("=", 1) for t in ready.split() if "=" in t)
    running = Server(binary, home, tokens["nats"], tokens["http"], log)
    running.cli("tenant", "add", TENANT)
    running.cli("tenant", "add", "globex")
    try:
        yield running
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@pytest.fixture(scope="session")
def alice_key(server: Server) -> str:
    """Agent ``planner``: the default scopes plus ``user:alice``."""
    return server.key(TENANT, "planner", "task:*", "session:*", "agent:planner", "user:alice")


@pytest.fixture(scope="session")
def bob_key(server: Server) -> str:
    """Agent ``helper``: the default scopes plus ``user:bob``."""
    return server.key(TENANT, "helper", "task:*", "session:*", "agent:helper", "user:bob")


@pytest.fixture(scope="session")
def globex_key(server: Server) -> str:
    return server.key("globex", "intruder")


@pytest.fixture
def task_scope() -> str:
    """A scope of its own for each test, so tests never see each other's memories."""
    return f"task:t-{uuid.uuid4().hex[:12]}"
