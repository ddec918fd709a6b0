"""LangGraph's durable execution across environments, as a user runs it: a graph interrupted
for human input on a hub (the cloud) is resumed on a leaf (a laptop), from the same
checkpoint, after the leaf was offline while the graph ran. Two real ``engram up``
processes with their own nats-servers, homes and HTTP APIs: the hub with ``--leaf-listen``,
the leaf with ``--leaf`` and the credentials ``engram leaf add`` wrote on the hub.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from langgraph.types import Command

from engram_client import Engram, RetryPolicy
from engram_client.checkpoint import EngramSaver

from .conftest import READY_TIMEOUT, Server, engram_bin
from .test_checkpoint import _builder

RETRY = RetryPolicy(max_retries=10)
TENANT = "acme"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ENGRAM_CONFIG", "ENGRAM_CREDS", "ENGRAM_HOME")}
    # The leaf must use the URL it is given only (the hub's own is the same here, but a
    # hub advertising itself is what a test of a cut link cannot have).
    env["ENGRAM_NATS__LEAFNODES_ADVERTISE"] = "false"
    return env


class Up:
    """One ``engram up`` process, started and stopped at will on the same home and ports."""

    def __init__(self, home: Path, args: list[str]) -> None:
        self.home, self.args = home, args
        self.child: subprocess.Popen[str] | None = None
        self.server: Server | None = None

    def start(self) -> Server:
        log = self.home / "up.log"
        with open(log, "a") as stderr:
            self.child = subprocess.Popen(
                [str(engram_bin()), "up", "--home", str(self.home), *self.args, "--http", "127.0.0.1:0"],
                env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
            )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.child.stdout], daemon=True).start()  # type: ignore[union-attr]
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if "engram is up" in line:
                break
            if self.child.poll() is not None or time.monotonic() > deadline:
                self.child.kill()
                raise RuntimeError(f"engram up {self.args} did not start:\n{log.read_text()[-4000:]}")
        tokens = dict(t.split("=", 1) for t in line.split() if "=" in t)
        self.server = Server(engram_bin(), self.home, tokens["nats"], tokens["http"], log)
        return self.server

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()


@pytest.fixture(scope="module")
def hub_and_leaf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Up]]:
    hub_home, leaf_home = tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("leaf")
    leafnodes = _free_port()
    hub = Up(hub_home, ["--nats-port", str(_free_port()), "--leaf-listen", f"127.0.0.1:{leafnodes}"])
    leaf = Up(leaf_home, ["--nats-port", str(_free_port()), "--leaf", f"nats-leaf://127.0.0.1:{leafnodes}",
                          "--creds", str(hub_home / "laptop.creds")])
    try:
        server = hub.start()
        server.cli("tenant", "add", TENANT)
        server.cli("leaf", "add", "laptop", "--tenant", TENANT, "--out", str(hub_home / "laptop.creds"))
        leaf.start()
        yield server, leaf
    finally:
        leaf.stop()
        hub.stop()


def _latest_checkpoint(graph: Any, config: Any) -> str | None:
    state = graph.get_state(config)
    return state.config.get("configurable", {}).get("checkpoint_id") if state.config else None


def test_a_graph_interrupted_on_the_hub_resumes_on_the_leaf_after_the_link_was_down(
    hub_and_leaf: tuple[Server, Up],
) -> None:
    hub, leaf_up = hub_and_leaf
    hub_key = hub.key(TENANT, "cloud-agent", "task:*", "session:*")
    # The leaf is online first, then goes offline: the graph runs on the hub without it.
    leaf_up.stop()

    config: Any = {"configurable": {"thread_id": f"release-{uuid.uuid4().hex[:8]}"}}
    cloud = _builder().compile(checkpointer=EngramSaver(Engram(hub.http, hub_key, retry=RETRY)))
    out = cloud.invoke({"question": "ship the migration tonight?", "log": ["opened"]}, config)
    assert out["__interrupt__"][0].value == {"question": "ship the migration tonight?"}
    waiting_at = _latest_checkpoint(cloud, config)
    assert waiting_at

    # The laptop comes back online; its own agent key, its own HTTP API.
    leaf = leaf_up.start()
    leaf_key = leaf.key(TENANT, "laptop-agent", "task:*", "session:*")
    laptop = _builder().compile(checkpointer=EngramSaver(Engram(leaf.http, leaf_key, retry=RETRY)))
    deadline = time.monotonic() + 120
    while _latest_checkpoint(laptop, config) != waiting_at:
        assert time.monotonic() < deadline, "the hub's checkpoint never reached the leaf"
        time.sleep(0.25)
    waiting = laptop.get_state(config)
    assert waiting.next == ("ask",)
    assert waiting.tasks[0].interrupts[0].value == {"question": "ship the migration tonight?"}

    # Resumed on the laptop from that checkpoint: the question is not asked again.
    done = laptop.invoke(Command(resume="no, on monday"), config)
    assert done["log"] == ["opened", "asked: ship the migration tonight?", "done: no, on monday"]
    resumed_at = _latest_checkpoint(laptop, config)
    # The laptop's steps go up: the hub sees the graph finished, from the same history.
    deadline = time.monotonic() + 120
    while _latest_checkpoint(cloud, config) != resumed_at:
        assert time.monotonic() < deadline, "the leaf's checkpoints never reached the hub"
        time.sleep(0.25)
    assert cloud.get_state(config).values["answer"] == "no, on monday"
    assert cloud.get_state(config).next == ()
    assert httpx.get(f"{leaf.http}/healthz", timeout=10).status_code == 200
