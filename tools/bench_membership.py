"""`specbus bench membership`: join, failure detection, leave and convergence, with real
node processes on loopback.

Each node runs `python -m nodes --print-events`, which prints one JSON line per membership
event stamped with `time.monotonic()`. CLOCK_MONOTONIC is system-wide on Linux, so times
from different processes on this machine compare directly with the benchmark's own clock.
Nodes are started with the project's one launcher, `tools.local_cluster.NodeProcess`.

With `--secret-file F` the whole run is done twice, plain then with the cluster secret (every
socket CURVE, gossip MACed), and the table puts the two side by side.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import uuid

from tools.local_cluster import NodeProcess, all_see_each_other, event_time, wait_all

# -- the benchmark ------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.env = env or {}
        self.cluster = f"bench-{uuid.uuid4().hex[:8]}"
        self.procs: list[NodeProcess] = []

    def spawn(self, *extra: str, module: str = "nodes") -> NodeProcess:
        p = NodeProcess(["--role", "proposer", "--drafter", "ngram", "--cluster", self.cluster,
                         *extra], module=module, env=self.env)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
        for p in self.procs:
            p.proc.wait()

    def join_leave_kill(self, trials: int) -> dict[str, list[float]]:
        base = [self.spawn() for _ in range(3)]
        if not wait_all(lambda: all_see_each_other(base), 15):
            raise RuntimeError("base cluster did not converge")
        out: dict[str, list[float]] = {"join_s": [], "dead_after_kill_s": [], "leave_s": []}
        for _ in range(trials):
            new = self.spawn()
            t0 = new.spawned_at
            nid = new.node_id
            dt = event_time(base, nid, "join", t0, 10)
            new_sees = wait_all(lambda new=new: all_see_each_other([*base, new]), 10)
            if dt is None or not new_sees:
                raise RuntimeError("a joining node was not seen by every member")
            mine = max(e["t"] for e in new.events if e["event"] == "join") - t0
            out["join_s"].append(max(dt, mine))
            time.sleep(0.3)
            t_term = new.signal(signal.SIGTERM)
            dt = event_time(base, nid, "leave", t_term, 5)
            if dt is None:
                raise RuntimeError("leave not seen")
            out["leave_s"].append(dt)
            new.proc.wait(5)
            victim = self.spawn()
            if not wait_all(lambda v=victim: all_see_each_other([*base, v]), 10):
                raise RuntimeError("victim did not join")
            time.sleep(0.3)
            t_kill = victim.signal(signal.SIGKILL)
            dt = event_time(base, victim.node_id, "dead", t_kill, 6)
            if dt is None:
                raise RuntimeError("killed node not declared dead")
            out["dead_after_kill_s"].append(dt)
            victim.proc.wait(5)
        for p in base:
            p.stop()
        return out

    def converge(self, n: int) -> dict[str, float]:
        procs = [self.spawn() for _ in range(n)]
        for p in procs:
            p.wait_ready(60)
        last_ready = max(p.ready["t"] for p in procs)
        first_spawn = min(p.spawned_at for p in procs)
        if not wait_all(lambda: all_see_each_other(procs), 30, step=0.05):
            raise RuntimeError(f"{n} nodes did not converge in 30 s")
        done = max(max((e["t"] for e in p.events if e["event"] == "join"), default=0)
                   for p in procs)
        steady = self.args.steady_s
        time.sleep(steady)
        for p in procs:
            p.proc.send_signal(signal.SIGTERM)
        rates_out, rates_in = [], []
        for p in procs:
            ev = p.wait_event(lambda e: e["event"] == "exit", 15)
            p.proc.wait(10)
            if ev is not None:
                life = ev["t"] - p.ready["t"]
                rates_out.append(ev["bytes_out"] / life)
                rates_in.append(ev["bytes_in"] / life)
        suspects = sum(len([e for e in p.events if e["event"] == "suspect"]) for p in procs)
        return {"converge_s": done - last_ready, "from_spawn_s": done - first_spawn,
                "spawn_to_last_ready_s": last_ready - first_spawn,
                "bytes_out": statistics.mean(rates_out), "bytes_in": statistics.mean(rates_in),
                "suspects": suspects}

    def busy(self, n_busy: int, n_idle: int, seconds: float) -> int:
        idle = [self.spawn() for _ in range(n_idle)]
        busy = [self.spawn("--busy-s", str(seconds), module="tools.busy_node")
                for _ in range(n_busy)]
        allp = idle + busy
        if not wait_all(lambda: all_see_each_other(allp), 15):
            raise RuntimeError("busy cluster did not converge")
        time.sleep(seconds + 0.5)
        count = sum(len([e for e in p.events if e["event"] in ("suspect", "dead")])
                    for p in allp)
        for p in allp:
            p.stop()
        return count


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 4), "max": round(max(values), 4),
            "n": len(values)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--trials", type=int, default=5,
                        help="join/leave/kill trials (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=20,
                        help="nodes in the convergence run (default: %(default)s)")
    parser.add_argument("--steady-s", type=float, default=5.0,
                        help="steady-state seconds for gossip bytes (default: %(default)s)")
    parser.add_argument("--busy-s", type=float, default=5.0,
                        help="seconds the CPU-bound nodes spin (default: %(default)s)")
    parser.add_argument("--secret-file", metavar="FILE",
                        help="also run everything with this cluster secret (CURVE + gossip "
                             "MAC) and compare with plain")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.trials <= 50 or not 2 <= args.nodes <= 40:
        print("specbus bench membership: --trials must be 1..50 and --nodes 2..40",
              file=sys.stderr)
        return 2
    if args.secret_file:
        from bus.security import SecretError, read_secret_file

        try:
            read_secret_file(args.secret_file)
        except SecretError as exc:
            print(f"specbus bench membership: {exc}", file=sys.stderr)
            return 2
        # nodes inherit the environment: an outer SPECBUS_SECRET_FILE must not leak into "plain"
        plain = measure(args, {"SPECBUS_SECRET_FILE": ""})
        curve = measure(args, {"SPECBUS_SECRET_FILE": str(args.secret_file)})
        result = {"plain": plain, "curve": curve}
        print(format_compare(plain, curve, args.nodes))
    else:
        result = measure(args, None)
        print(format_table(result, args.nodes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


def measure(args: argparse.Namespace, env: dict[str, str] | None) -> dict:
    bench = Bench(args, env)
    try:
        jlk = bench.join_leave_kill(args.trials)
        conv = bench.converge(args.nodes)
        busy = bench.busy(n_busy=3, n_idle=3, seconds=args.busy_s)
    finally:
        bench.close()
    return {
        "join_s": summary(jlk["join_s"]),
        "dead_after_kill_s": summary(jlk["dead_after_kill_s"]),
        "leave_s": summary(jlk["leave_s"]),
        f"converge_{args.nodes}_s": round(conv["converge_s"], 4),
        f"converge_{args.nodes}_from_spawn_s": round(conv["from_spawn_s"], 4),
        f"spawn_to_last_ready_{args.nodes}_s": round(conv["spawn_to_last_ready_s"], 4),
        "false_suspicions": busy + conv["suspects"],
        "false_suspicions_busy_run": busy,
        "false_suspicions_convergence_run": conv["suspects"],
        "gossip_bytes_per_s_per_node": round(conv["bytes_out"], 1),
        "gossip_bytes_in_per_s_per_node": round(conv["bytes_in"], 1),
        "nodes": args.nodes,
        "timeouts": {"heartbeat": 0.2, "suspect_after": 0.8, "dead_after": 1.6},
    }


def format_compare(plain: dict, curve: dict, n: int) -> str:
    """Plain and CURVE side by side (p50 and max where there are several trials)."""
    def both(key: str, fmt: str = "{:.3f}") -> tuple[str, str]:
        a, b = plain[key], curve[key]
        if isinstance(a, dict):
            return (f"p50 {a['p50']:.3f} max {a['max']:.3f}",
                    f"p50 {b['p50']:.3f} max {b['max']:.3f}")
        return fmt.format(a), fmt.format(b)

    rows = [("join (start -> seen by all), s", *both("join_s")),
            ("dead after SIGKILL, s", *both("dead_after_kill_s")),
            ("leave after SIGTERM, s", *both("leave_s")),
            (f"converge, {n} nodes (last ready), s", *both(f"converge_{n}_s")),
            ("false suspicions", *both("false_suspicions", "{}")),
            ("gossip bytes/s out per node", *both("gossip_bytes_per_s_per_node", "{:.0f}"))]
    head = ("metric", "plain", "curve")
    widths = [max(len(r[i]) for r in (*rows, head)) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in (head, *rows))


def format_table(r: dict, n: int) -> str:
    rows = [
        ("join (start -> seen by all)", f"p50 {r['join_s']['p50']:.3f} s", "max "
         f"{r['join_s']['max']:.3f} s", "<= 1.0 s p50"),
        ("dead after SIGKILL", f"p50 {r['dead_after_kill_s']['p50']:.3f} s",
         f"max {r['dead_after_kill_s']['max']:.3f} s", "<= 2.0 s"),
        ("leave after SIGTERM", f"p50 {r['leave_s']['p50']:.3f} s",
         f"max {r['leave_s']['max']:.3f} s", "<= 0.2 s"),
        (f"converge, {n} nodes (last ready)", f"{r[f'converge_{n}_s']:.3f} s",
         f"from spawn {r[f'converge_{n}_from_spawn_s']:.3f} s", "<= 3 s"),
        ("false suspicions", str(r["false_suspicions"]), "", "0"),
        ("gossip bytes/s per node", f"out {r['gossip_bytes_per_s_per_node']:.0f}",
         f"in {r['gossip_bytes_in_per_s_per_node']:.0f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    head = ("metric", "value", "", "target")
    widths = [max(w, len(h)) for w, h in zip(widths, head, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)
