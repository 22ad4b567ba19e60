"""Round time on slow links: each SuperNode in a network namespace of its own, behind a link
shaped to an edge-like rate, FedCyBGD beside FedAvg-LoRA and FedAvg-full on SmolLM2.

The network is real and private to the experiment: a namespace ``fcb-link`` holds a bridge
(10.77.0.1/24) and the SuperLink, the ServerApp and the ``flwr`` CLI (this script re-runs itself
there); each node has a namespace ``fcb-node-K`` (10.77.0.1K) joined to the bridge by a veth pair.
Both ends of every node's link are shaped with ``tc`` ``tbf`` at ``--rates`` Mbit/s (the node's
end: its uplink; the bridge's end: its downlink). No address outside these namespaces is used,
and they are removed at the end (also after a failure or Ctrl-C). Needs root (``ip netns``).

Per method and rate, a 2-node, 2-round run on the loopback deployment's machinery
(:class:`fedcybgd.deploy.local.LocalDeployment`, insecure): round 1 shows the first downloads
(FedAvg sends the whole model or adapter; FedCyBGD nodes hold the pretrained weights already),
round 2 a steady round. Reported per round: wall time (``round_s``), bytes on the wire each way
(``wire_bytes_*``: what Flower carried, summed over the nodes), the node's training time, and
the time the link alone needs for those bytes at the rate (one node's share, down plus
up, over the rate).
Methods run at their app defaults (FedCyBGD: int2 deltas up and down). The SuperLink keeps its
state in memory here: with its SQLite file, FedAvg-full's 513 MB messages locked the database
long enough for heartbeats and task pulls to fail, and that run died in its first round.

    python experiments/slow_links.py                      # 20 and 2 Mbit/s, all three methods
    python experiments/slow_links.py --rates 20 --methods fedcybgd,fedavg-lora

Results: ``experiments/results/slow_links/results.json`` (each run appended, ``--resume``
skips done ones) and ``table.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "slow_links"
LINK_NS = "fcb-link"
LINK_IP = "10.77.0.1"
NODES = 2
METHODS: dict[str, str] = {
    "fedcybgd": "",
    "fedavg-lora": "strategy='fedavg' fedavg-params='lora'",
    "fedavg-full": "strategy='fedavg' fedavg-params='full'",
}
# SmolLM2 at the app's defaults, two nodes, two rounds; a small server evaluation (before and
# after) so the rounds are mostly training and transfer.
RUN = (f"model='smollm2-135m' num-server-rounds=2 clients-per-round={NODES} "
       "eval-every=0 eval-examples=16 partitioner='iid'")


def node_ns(k: int) -> str:
    return f"fcb-node-{k}"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


class Network:
    """The namespaces, bridge, veth pairs and shaping of one experiment (context manager)."""

    def __init__(self, nodes: int, rate_mbit: float) -> None:
        self.nodes, self.rate = nodes, rate_mbit

    def shape(self, ns: str, dev: str) -> None:
        # tbf: the rate, a burst of ~10 ms at the rate (at least one MTU), 200 ms of queue
        burst = max(int(self.rate * 1e6 / 8 * 0.01), 3000)
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
           "rate", f"{self.rate}mbit", "burst", str(burst), "latency", "200ms")

    def __enter__(self) -> Network:
        self.remove()  # leftovers of an interrupted run
        sh("ip", "netns", "add", LINK_NS)
        sh("ip", "-n", LINK_NS, "link", "set", "lo", "up")
        sh("ip", "-n", LINK_NS, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", LINK_NS, "addr", "add", f"{LINK_IP}/24", "dev", "br0")
        sh("ip", "-n", LINK_NS, "link", "set", "br0", "up")
        for k in range(1, self.nodes + 1):
            ns, node_dev, link_dev = node_ns(k), f"fcbv{k}", f"fcbp{k}"
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", node_dev, "netns", ns, "type", "veth", "peer", "name",
               link_dev, "netns", LINK_NS)
            sh("ip", "-n", ns, "addr", "add", f"10.77.0.1{k}/24", "dev", node_dev)
            sh("ip", "-n", ns, "link", "set", node_dev, "up")
            sh("ip", "-n", LINK_NS, "link", "set", link_dev, "master", "br0")
            sh("ip", "-n", LINK_NS, "link", "set", link_dev, "up")
            self.shape(ns, node_dev)  # uplink
            self.shape(LINK_NS, link_dev)  # downlink
        return self

    def remove(self) -> None:
        names = [LINK_NS, *(node_ns(k) for k in range(1, self.nodes + 1))]
        for ns in names:  # deleting a namespace deletes its links (and the veth peers)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False,
                           timeout=60)

    def __exit__(self, *exc: object) -> None:
        self.remove()


@dataclass
class NodeNamespace:
    """Runs each SuperNode in its network namespace (the deployment's node wrapper)."""

    def describe(self) -> str:
        return f"SuperNodes in network namespaces {node_ns(1)}..{node_ns(NODES)}"

    def command(self, state: Path, node: str, cmd: list[str],
                env: dict[str, str]) -> list[str]:
        k = int(node.rsplit("-", 1)[1])  # supernode-K
        return ["ip", "netns", "exec", node_ns(k), *cmd]

    def remove(self, state: Path, node: str) -> None:
        return None


def inner(method: str, rate: float, out: Path, extra: str = "") -> dict[str, Any]:
    """One run, in the link namespace: SuperLink on all its addresses, nodes dialling the
    bridge's address from their namespaces."""
    from fedcybgd.deploy.commands import merge_config, superlink_command
    from fedcybgd.deploy.local import LocalDeployment

    class Namespaced(LocalDeployment):
        @property
        def fleet_address(self) -> str:
            return f"{LINK_IP}:{self.port}"

        def superlink_args(self) -> list[str]:
            # the state in memory: with its SQLite file, FedAvg-full's 513 MB messages held
            # the database long enough that heartbeats and task pulls failed with "database
            # is locked" and the run died in round 1 (see the note in the results' README)
            cmd = superlink_command(host="0.0.0.0", port=self.port, database="-")
            at = cmd.index("--database")
            return cmd[:at] + cmd[at + 2:]

    with tempfile.TemporaryDirectory(prefix="fedcybgd-slow-") as tmp:
        dep = Namespaced(Path(tmp) / "state", out / "logs", threads_per_process=1,
                         node_container=NodeNamespace())  # type: ignore[arg-type]
        with dep:
            dep.start_superlink()
            dep.start_supernodes(NODES)
            dep.wait_nodes(NODES, timeout=300)
            began = time.monotonic()
            config = merge_config(merge_config(RUN, METHODS[method]),
                                  f"{extra} output-dir='{out}' overwrite=true")
            run_id = dep.submit(config)
            status = dep.wait_run(run_id, timeout=4 * 3600)
            wall = time.monotonic() - began
            dep.save_run_log(run_id)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for bulky in ("final", "checkpoint"):  # the model (540 MB): not a result of this experiment
        shutil.rmtree(out / bulky, ignore_errors=True)
    rounds = []
    for r in rows[1:]:
        rounds.append({"round": r["round"], "round_s": r.get("round_s"),
                       "wire_bytes_down": r.get("wire_bytes_down"),
                       "wire_bytes_up": r.get("wire_bytes_up"),
                       "client_train_s": r.get("client_train_s"),
                       # one node's bytes each way through its own link, down then up
                       "link_s": (r.get("wire_bytes_down", 0) + r.get("wire_bytes_up", 0))
                       / NODES * 8 / (rate * 1e6)})
    return {"method": method, "rate_mbit": rate, "status": status, "run_wall_s": wall,
            "rounds": rounds}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| rate | method | round | round time | on the wire down / up (per node) "
             "| link time for those bytes | node training |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (-r["rate_mbit"], list(METHODS).index(r["method"]))):
        for x in r["rounds"]:
            lines.append(
                f"| {r['rate_mbit']:g} Mbit/s | {r['method']} | {x['round']} "
                f"| {x['round_s']:.1f} s | {x['wire_bytes_down'] / NODES / 1e6:.2f} / "
                f"{x['wire_bytes_up'] / NODES / 1e6:.2f} MB | {x['link_s']:.1f} s "
                f"| {x['client_train_s']:.1f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    # Ctrl-C or a SIGTERM (a background job ignores SIGINT) stops the run cleanly: the
    # deployment's processes end and the namespaces are removed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="20,2", help="Mbit/s, comma-separated")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--run-config", default="",
                        help="more run-config keys for every run (e.g. a smaller model to try "
                             "the network out; such runs are not SmolLM2's figures)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--inner", nargs=3, metavar=("METHOD", "RATE", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        method, rate, out = args.inner
        print("RESULT " + json.dumps(inner(method, float(rate), Path(out), args.run_config)),
              flush=True)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results: list[dict[str, Any]] = (json.loads(path.read_text())
                                     if args.resume and path.exists() else [])
    for rate in (float(x) for x in args.rates.split(",")):
        for method in methods:
            if any(r["method"] == method and r["rate_mbit"] == rate for r in results):
                continue
            run_out = args.out / "runs" / f"{method}-{rate:g}mbit"
            print(f"--- {method} at {rate:g} Mbit/s", flush=True)
            with Network(NODES, rate):
                inner_run = subprocess.Popen(
                    ["ip", "netns", "exec", LINK_NS, sys.executable, __file__, "--inner",
                     method, str(rate), str(run_out.resolve()), "--run-config",
                     args.run_config],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    stdout, stderr = inner_run.communicate()
                except KeyboardInterrupt:  # let the inner run stop its deployment first
                    inner_run.send_signal(signal.SIGTERM)
                    inner_run.communicate(timeout=120)
                    raise
            lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            if inner_run.returncode or not lines:
                print(stdout[-3000:] + stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{method} at {rate:g} Mbit/s failed (logs: {run_out})")
            results.append(json.loads(lines[-1][len("RESULT "):]))
            path.write_text(json.dumps(results, indent=1) + "\n")
            print(table([results[-1]]), flush=True)
    (args.out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
