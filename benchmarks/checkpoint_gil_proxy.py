"""A CPU proxy for the cost of a background checkpoint write to the training thread (issue 17 item 4).

The training thread of a GPU job spends its time dispatching small operators from Python, holding the
GIL between them; a background write that holds the GIL for long stretches slows it however many
cores are idle. This script times such a loop (a small MLP's train step: dozens of small ops) alone
and while another thread writes a checkpoint-sized state (``--mb`` MB in ``--tensors`` tensors) through

* ``bytes``: the old writer: ``torch.save`` into a BytesIO, ``getvalue()``, SHA-256, write, fsync;
* ``stream``: `distributed_training.checkpoint.atomic_save`: ``torch.save`` straight into the file,
  hashed on the way.

each writer run once in a thread and once in a forked process (same CPU work, no shared GIL: the
control, since on a machine whose cores are busy the writer's CPU use slows the loop too), and prints
the loop's time per step during the write (as % over the loop alone), its longest step
during the write (a writer holding the GIL for a whole memcpy of the file shows as one long stall,
which CPU contention from other processes does not produce) and the write's seconds. Run: ``PYTHONPATH=. python benchmarks/checkpoint_gil_proxy.py [--mb 1024] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import threading
import time

import torch
from torch import nn

from distributed_training.checkpoint import atomic_save, atomic_write_bytes
from distributed_training.checkpoint_async import serialize, sha256


def _old(obj, path: str) -> str:
    data = serialize(obj)
    atomic_write_bytes(data, path)
    return sha256(data)


WRITERS = {"bytes": _old, "stream": atomic_save}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="size of the state written (MB)")
    parser.add_argument("--tensors", type=int, default=450, help="how many tensors it is cut into")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = args.mb * 2**20 // 4 // args.tensors
    state = {"params": {f"p{i}": [(0, torch.randn(numel))] for i in range(args.tensors)}, "step": 3}
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(12)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(8, 32), torch.randn(8, 32)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def loop_alone(seconds: float) -> tuple[float, float]:
        n, start, longest = 0, time.perf_counter(), 0.0
        while (now := time.perf_counter()) - start < seconds:
            step()
            longest = max(longest, time.perf_counter() - now)
            n += 1
        return (time.perf_counter() - start) / n, longest

    directory = args.dir or tempfile.mkdtemp(prefix="gil-proxy-")
    for _ in range(20):
        step()
    runs = [(name, where) for name in WRITERS for where in ("thread", "process")]
    results: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] = {r: [] for r in runs}
    fork = multiprocessing.get_context("fork")
    for rep in range(args.repeats):
        for name, where in runs:
            write = WRITERS[name]
            path = os.path.join(directory, f"{name}.pt")
            done = threading.Event()
            took = [0.0]

            def job() -> None:
                t0 = time.perf_counter()
                write(state, path)
                took[0] = time.perf_counter() - t0
                done.set()

            base, base_longest = loop_alone(1.0)
            thread = threading.Thread(target=job) if where == "thread" else fork.Process(target=write, args=(state, path))
            n, start, longest = 0, time.perf_counter(), 0.0
            thread.start()
            while not done.is_set() if where == "thread" else thread.is_alive():
                t0 = time.perf_counter()
                step()
                longest = max(longest, time.perf_counter() - t0)
                n += 1
            during = (time.perf_counter() - start) / max(n, 1)
            thread.join()
            if where == "process":
                took[0] = time.perf_counter() - start
            results[(name, where)].append((base, during, took[0], base_longest, longest))
            os.remove(path)
            print(f"  {name:6s} {where:7s} round {rep}: loop {base * 1e3:.3f} ms/step alone (longest {base_longest * 1e3:.0f} ms), "
                  f"{during * 1e3:.3f} during the write ({100 * (during - base) / base:+.1f}%, longest "
                  f"{longest * 1e3:.0f} ms), write {took[0]:.2f} s", flush=True)
    print(f"{args.mb} MB in {args.tensors} tensors, torch {torch.__version__}; median over {args.repeats} rounds:")
    for (name, where), rows in results.items():
        slow = statistics.median(100 * (r[1] - r[0]) / r[0] for r in rows)
        print(f"  {name:6s} in a {where:7s}: training loop {slow:+.1f}% slower during the write, longest step "
              f"{1e3 * statistics.median(r[4] for r in rows):.0f} ms (alone: {1e3 * statistics.median(r[3] for r in rows):.0f}); "
              f"write {statistics.median(r[2] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
