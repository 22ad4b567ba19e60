"""A Grid whose nodes run in a child process; messages cross as Flower protobuf bytes.

The loopback Grid runs the clients inside the server's process, so a client's memory cannot be
told apart from the server's. Here one child process plays every node in turn (as one Ray
worker or one SuperNode's ClientApp process would), so its resident memory is the client's own:
each reply comes back with the child's peak RSS while it handled that message, and the size of
both serialised messages. Frames on the pipe are raw bytes (a JSON header, then Flower's
protobuf encoding); nothing is pickled.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import resource
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity

from fedcybgd.core.measure import PeakMemory
from fedcybgd.core.registry import resolve
from fedcybgd.harness.loopback import LocalGrid, node_configs


@dataclass
class Exchange:
    """One message to a node and its reply, as measured."""

    node_id: int
    bytes_down: int  # the serialised instruction
    bytes_up: int  # the serialised reply
    peak_rss_mb: float  # the client process's peak RSS (sampled) while handling it
    seconds: float  # handling time in the client process
    # The kernel's lifetime peak (ru_maxrss). Linux carries it over fork and exec, so it starts
    # at the parent's RSS when the child was spawned: an upper bound, not the client's peak.
    max_rss_mb: float
    message_type: str = "train"  # Flower's message type (train, or a query such as node keys)


def _frame(header: dict[str, Any], body: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<I", len(head)) + head + body


def _unframe(frame: bytes) -> tuple[dict[str, Any], memoryview]:
    (size,) = struct.unpack_from("<I", frame)
    view = memoryview(frame)  # no copy of the body
    return json.loads(bytes(view[4 : 4 + size])), view[4 + size :]


def _claim_identity(node_id: int) -> None:
    # Flower's runtimes set who creates messages; the child plays "the SuperNode".
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = 1


def _handle(inbox: list[bytes], client_app: Any, contexts: dict[int, Context]) -> bytes:
    """One message: decode, run the ClientApp, encode the reply (all inside the measurement).

    The frame comes in a list so that this function holds its only reference and can drop the
    received bytes once decoded, as a runtime does.
    """
    began = time.perf_counter()
    with PeakMemory() as mem:
        frame = inbox.pop()
        header, body = _unframe(frame)
        proto = ProtoMessage()
        proto.ParseFromString(body)
        del body, frame
        message = message_from_proto(proto)
        del proto
        try:
            reply = client_app(message, contexts[header["node"]])
        except Exception as err:  # a runtime turns a crash into an error reply
            error = Error(int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION),
                          f"{type(err).__name__}: {err}")
            reply = Message(error, reply_to=message)
        del message
        out = message_to_proto(reply).SerializeToString()
        del reply
    stats = {"peak_rss_mb": mem.peak_mb, "seconds": time.perf_counter() - began,
             "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return _frame(stats, out)


def _exit_with(parent: int, every: float = 1.0) -> None:
    """End the child once the process that spawned it is gone (killed, not closed).

    Without this a child busy with a message trains on until it tries to reply, minutes of CPU
    for nobody on a long message.
    """
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


def _serve(conn: Connection, app_ref: str, contexts_json: str, threads: int) -> None:
    """The child: run the ClientApp for each framed message until an empty frame arrives."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    if threads:
        import torch

        torch.set_num_threads(threads)
    _claim_identity(node_id=0)  # the child's replies are made by "the SuperNode"
    client_app = resolve(app_ref)
    contexts = {
        int(node): Context(run_id=1, node_id=int(node), node_config=spec["node_config"],
                           state=RecordDict(), run_config=spec["run_config"])
        for node, spec in json.loads(contexts_json).items()
    }
    while True:
        inbox = [conn.recv_bytes()]
        if not inbox[0]:
            # Every reply has been sent and every file the ClientApp writes is written before
            # its reply; skip the interpreter's teardown (torch's alone costs about a second).
            sys.stdout.flush()
            sys.stderr.flush()
            conn.close()
            os._exit(0)
        # Locals of one message (its reply included) die before the next is received, so no
        # message's memory is counted in another's peak.
        conn.send_bytes(_handle(inbox, client_app, contexts))


class ProcessGrid(LocalGrid):
    """A Grid whose nodes are served, one message at a time, by one child process.

    Parameters
    ----------
    app_ref : str
        The ClientApp as ``"module:attribute"`` (imported in the child).
    num_nodes : int
        Number of nodes; node ``i`` gets ``partition-id = i`` and ``num-partitions``.
    run_config : dict
        The run config every node's Context sees.
    node_config : Callable[[int], dict], optional
        Extra node config for node ``i``.
    threads : int, optional
        torch threads in the child (0: torch's default).
    timeout : float, optional
        Seconds to wait for one reply before the run stops (the child is one process: a
        crash or a hang ends the run, unlike a real runtime where only that reply is lost).
    """

    def __init__(
        self,
        app_ref: str,
        num_nodes: int,
        run_config: dict[str, Any],
        node_config: Callable[[int], dict[str, Any]] | None = None,
        first_node_id: int = 1001,
        threads: int = 0,
        timeout: float = 3600.0,
    ) -> None:
        configs = node_configs(num_nodes, node_config, first_node_id)
        super().__init__(list(configs))
        self.timeout = timeout
        contexts = {node: {"node_config": config, "run_config": dict(run_config)}
                    for node, config in configs.items()}
        self.exchanges: list[Exchange] = []
        ctx = mp.get_context("spawn")  # no fork of a process holding torch threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(child, app_ref, json.dumps(contexts), threads), daemon=True
        )
        self._process.start()
        child.close()

    def close(self) -> None:
        """Stop the child process."""
        if self._process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send_bytes(b"")
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def __enter__(self) -> ProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peak_rss_mb(self) -> float:
        """The client process's highest sampled peak RSS over all messages so far."""
        return max((e.peak_rss_mb for e in self.exchanges), default=0.0)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Send each message to the child, wait for its reply and keep it."""
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            node = message.metadata.dst_node_id
            if node not in self.node_ids:
                raise ValueError(f"no node {node} on this grid")
            body = message_to_proto(message).SerializeToString()
            try:
                self._conn.send_bytes(_frame({"node": node}, body))
                if not self._conn.poll(self.timeout):
                    raise RuntimeError(
                        f"node {node} sent no reply within {self.timeout:.0f} s (the client "
                        "process hangs); the run stops"
                    )
                frame = self._conn.recv_bytes()
            except (EOFError, BrokenPipeError, ConnectionResetError):
                code = self._process.exitcode
                raise RuntimeError(
                    f"the client process died (exit code {code}) while node {node} handled a "
                    "message; if the code is -9 it was probably killed for memory"
                ) from None
            header, reply_body = _unframe(frame)
            proto = ProtoMessage()
            proto.ParseFromString(reply_body)
            reply = message_from_proto(proto)
            if reply.metadata.reply_to_message_id != message.metadata.message_id:
                raise RuntimeError(f"node {node} answered another message than the one sent")
            self.exchanges.append(Exchange(node, len(body), len(reply_body),
                                           float(header["peak_rss_mb"]),
                                           float(header["seconds"]),
                                           float(header["max_rss_mb"]),
                                           message.metadata.message_type))
            self._replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids
