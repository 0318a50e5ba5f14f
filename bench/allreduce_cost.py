"""The cross-node gradient all-reduce: its cost per step, computed, and measured with gloo here.

Across nodes each step all-reduces the drafter's fp32 gradients once (parallel/gradients.py).
A ring all-reduce over N nodes sends and receives 2(N-1)/N of the buffer on every node's link,
so with B bytes of gradients and a link of W bytes/s it takes about 2(N-1)/N x B / W (plus 2(N-1)
latencies, negligible at gigabytes). The table gives that for a 1B-parameter drafter (the
Qwen3-8B-shaped drafter of docs/PERF.md, 5 layers, has 1.05B) at 100 and 400 Gbit/s.

`--measure` checks the model on this machine: N processes on localhost (gloo over loopback TCP)
exchange B bytes pairwise (the link's bandwidth, measured) and all-reduce B bytes; the all-reduce
time is compared with 2(N-1)/N x B / (measured link bandwidth).

    python bench/allreduce_cost.py
    python bench/allreduce_cost.py --measure --params 64e6,256e6,1e9 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


def ring_seconds(nbytes: float, nodes: int, bytes_per_second: float) -> float:
    return 2 * (nodes - 1) / nodes * nbytes / bytes_per_second


def table(params: float, nodes: list[int], links_gbit: list[float]) -> list[str]:
    nbytes = 4 * params
    lines = [f"fp32 gradients of {params / 1e9:.2f}B parameters = {nbytes / 1e9:.2f} GB; ring all-reduce per step:",
             "| nodes | " + " | ".join(f"{g:g} Gbit/s" for g in links_gbit) + " |",
             "|---|" + "---|" * len(links_gbit)]
    for n in nodes:
        cells = [f"{1000 * ring_seconds(nbytes, n, g * GBIT):.0f} ms" for g in links_gbit]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, exchange_limit: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    out = []
    for numel in sizes:
        buffer = torch.ones(numel, dtype=torch.float32)
        exchanged = numel <= exchange_limit  # above it, no second buffer of that size (memory)
        peer_in = torch.empty(numel if exchanged else 1, dtype=torch.float32)
        partner = rank ^ 1 if (rank ^ 1) < world and exchanged else None
        exchange, reduce = [], []
        for i in range(repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            if partner is not None:  # both directions at once, as every link of a ring carries
                sends = [dist.isend(buffer, partner), dist.irecv(peer_in, partner)]
                for work in sends:
                    work.wait()
            dist.barrier()
            if i:
                exchange.append(time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            dist.barrier()
            if i:
                reduce.append(time.perf_counter() - started)
        assert float(buffer[0]) == world ** (repeats + 1), "all-reduce result"
        out.append({"numel": numel, "exchange_s": statistics.median(exchange) if exchanged else None,
                    "all_reduce_s": statistics.median(reduce)})
        del buffer, peer_in
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def measure(sizes: list[int], ranks: int, repeats: int, exchange_limit: int) -> list[dict]:
    need = 1.2 * ranks * 4 * max(n + (n if n <= exchange_limit else 0) for n in sizes)  # bytes, all ranks
    available = _available_memory()
    if available is not None and need > available:
        raise SystemExit(f"{need / 1e9:.1f} GB needed for {ranks} ranks of {max(sizes) / 1e9:.2f}B floats, "
                         f"{available / 1e9:.1f} GB available: pass smaller --params")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(_worker, args=(ranks, port, sizes, repeats, exchange_limit, results), nprocs=ranks, join=True,
                       start_method="spawn")
    return results.get()


def _available_memory() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter-params", type=float, default=1e9, help="parameters of the drafter for the table")
    parser.add_argument("--nodes", default="2,4,8,16,64")
    parser.add_argument("--links", default="100,400", help="link speeds in Gbit/s")
    parser.add_argument("--measure", action="store_true", help="also measure gloo on localhost")
    parser.add_argument("--params", default="64e6,256e6", help="buffer sizes (fp32 elements) to measure")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exchange-limit", type=float, default=256e6,
                        help="larger buffers are not exchanged pairwise (a second buffer that size); "
                             "their link bandwidth is the largest exchanged size's")
    args = parser.parse_args()
    print("\n".join(table(args.drafter_params, [int(n) for n in args.nodes.split(",")],
                          [float(g) for g in args.links.split(",")])))
    if not args.measure:
        return
    sizes = sorted(int(float(p)) for p in args.params.split(","))
    print(f"\nmeasured here: gloo, {args.ranks} processes on localhost, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"median of {args.repeats}")
    print("| fp32 elements | GB | pairwise exchange | link GB/s | all-reduce | predicted 2(N-1)/N x B / link | ratio |")
    print("|---|---|---|---|---|---|---|")
    rows = measure(sizes, args.ranks, args.repeats, int(args.exchange_limit))
    link = None
    for row in rows:
        nbytes = 4 * row["numel"]
        link = nbytes / row["exchange_s"] if row["exchange_s"] else link
        if link is None:
            raise SystemExit("no buffer was exchanged: include a size <= --exchange-limit")
        predicted = ring_seconds(nbytes, args.ranks, link)
        row.update(link_bytes_per_s=link, predicted_s=predicted)
        exchange = f"{row['exchange_s']:.3f} s" if row["exchange_s"] else "(not run)"
        print(f"| {row['numel'] / 1e6:.0f}M | {nbytes / 1e9:.2f} | {exchange} | {link / 1e9:.2f} | "
              f"{row['all_reduce_s']:.3f} s | {predicted:.3f} s | {row['all_reduce_s'] / predicted:.2f} |")
    print(json.dumps({"allreduce_cost": rows}))


if __name__ == "__main__":
    main()
