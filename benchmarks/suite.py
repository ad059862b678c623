"""The benchmark suite: one command measures our implementations against torch's on the devices at hand,
phase by phase, and checks the scaling model (`distributed_training.scaling`) against what it measured.

    python benchmarks/suite.py                          # every GPU here: worlds 1, 2, 4, ... up to all of them
    python benchmarks/suite.py --phases training,models --max-gpus 2
    python benchmarks/suite.py --smoke                  # CPU, gloo, 2 processes, toy sizes: what CI runs
    python benchmarks/suite.py --smoke --worlds 2,4 --phases pipeline   # CPU, gloo, 2 then 4 processes
    python benchmarks/suite.py --report DIR             # redo model check, markdown and plots from DIR/results.json
    python benchmarks/suite.py --merge A B --out DIR    # one results.json from runs made in parts (same machine)
    benchmarks/run_suite_gpu.sh                         # the GPU machine: NCCL tests, then this, under $OUT

Phases (`--phases`, default all; see `phases/__init__.py` for where each runs):

    collectives   NCCL's collectives vs our ring / tree / hierarchical and compressed reductions; overlap
    training      GPT: our DDP / ZeRO-1/2/3 / compressed DDP vs torch DDP and FSDP2, interleaved in one job
    models        timm / Hugging Face models: our DDP and trainer vs torch DDP
    images        our ResNet-50 / ViT-B/16: images/s per GPU, our DDP vs torch DDP, synthetic and from JPEGs
    accuracy      time to accuracy: the digits image recipe through dtrain until it reaches the target
    precision     our trainer in fp32 / bf16 / fp16: step time, memory, loss against fp32's
    topk          Top-K selection methods and PowerSGD, per bucket and per step (25 and 100 MiB buckets)
    profiling     where a DDP step's time goes, by kernel (GPU) or operator (CPU) category
    monitor       the monitor's cost on the trainer, at every world size
    checkpoint    a checkpoint every N steps, synchronous vs in the background, as % of step time
    memory        GPT 1.3B: activation checkpointing off/on, and batch_size="auto"
    pipeline      GPT over a pipeline: our GPipe / 1F1B / interleaved / ZB-H1 vs torch.distributed.pipelining
    compile       GPT tokens/s: eager vs torch.compile in both orders and per block under our DDP
    pipeline_trainer  GPT through DistributedTrainer(pipeline_parallel_size=P) vs our DDP trainer
    tensor        GPT 1.3B / ~7B: our tensor (and sequence) parallelism vs torch's DTensor TP, same plan
    ps            the parameter server vs our DDP (sparse embedding tables); sync vs ssp vs async
    imagenet_projection  ResNet-50 / ImageNet epoch time at 8-256 GPUs: the scaling model's projection
    model_check   the scaling model: one calibration, checked on this run and on recorded DDP runs

For each world size the orchestrator starts one job on this script (``--worker``; `torchrun` for two
or more ranks; a smoke run with DT_SUITE_FORK_WORKERS=1, as the tests make it, forks the job's ranks from
the orchestrator instead, with torchrun's variables and the same arguments), which runs every selected phase that belongs at that size in the same processes and
writes its part after each phase (so a phase that dies leaves the earlier ones). Then it merges the
parts into ``results.json`` under ``--out`` (default ``benchmarks/results/<date>-<card>/``): the
environment (card, torch, CUDA, NCCL, driver, world sizes) and every phase's raw figures, a skipped
phase with its reason; runs the model check; writes ``results.md`` and PNG plots (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from phases import PHASES  # noqa: E402

RECORDED_DDP = HERE / "results" / "ddp_2026-11-26_h200.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes (more with --worlds), toy sizes (CI)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of: {', '.join(PHASES)}")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<date>-<card>; "
                   "with --smoke benchmarks/out/smoke, ignored by git)")
    p.add_argument("--max-gpus", type=int, default=None, help="the largest world (default: every GPU here)")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default 1, 2, 4, ... largest)")
    p.add_argument("--models", default=None,
                   help="GPT presets as preset:micro_batch:seq, comma-separated (training; the first for precision "
                        "and monitor, the last for profiling and memory)")
    p.add_argument("--impls", default=None, help="training implementations (see common.py), comma-separated")
    p.add_argument("--accum", type=int, default=1, help="training: micro-batches per optimizer step")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per phase")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round")
    p.add_argument("--third-party", default=None, help="models phase: resnet50,bert,vit,gpt2,toy_cnn")
    p.add_argument("--variants", default=None, help="models phase variants (see phases/models.py); "
                   "pipeline_trainer: 'big' trains a GPT too large for one GPU (~7-10B) at P = world size; "
                   "pipeline: layouts 'pp' (P = world), 'pp_dp' (P = world/2 x DP = 2) and balances 'compute', "
                   "'time' (default pp,pp_dp,compute); tensor: 'big' the ~7B points only, 'small' the 1.3B's")
    p.add_argument("--models-profile", type=int, default=0, help="models phase: profile the first N variants")
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--recorded", nargs="*", default=None,
                   help=f"model_check: recorded DDP runs (default {RECORDED_DDP.relative_to(HERE.parent)})")
    p.add_argument("--timeout", type=float, default=None, help="seconds per world size before it counts as hung")
    p.add_argument("--report", default=None, help="only rebuild model check and report from this folder")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULTS",
                   help="merge results.json files (or folders holding one) of runs on one machine into --out, "
                        "then report: a later part's phase at a world replaces an earlier one's")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = [x for x in args.phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {', '.join(unknown)}; known: {', '.join(PHASES)}")
    if args.models:
        try:
            args.models = [(m.split(":")[0], int(m.split(":")[1]), int(m.split(":")[2])) for m in args.models.split(",")]
        except (IndexError, ValueError):
            p.error(f"--models takes preset:micro_batch:seq entries, got {args.models!r}")
    if args.recorded is None:
        args.recorded = [str(RECORDED_DDP)] if RECORDED_DDP.is_file() else []
    return args


# ------------------------------------------------------------------------------------------ worker
def worker(args) -> None:
    from common import environment
    from distributed_training import init_distributed

    ctx = init_distributed(device="cpu" if args.smoke else None)
    part = {**environment(ctx.world_size), "backend": ctx.backend, "phases": {}, "phase_seconds": {}}

    def write() -> None:  # rank 0's part file: what the orchestrator reads, even after a timeout
        Path(args.part).write_text(json.dumps(part, indent=1, default=str))

    def save_partial(name: str, result: dict) -> None:
        """What a long phase has finished so far (rank 0's), on file with ``partial: True``: if the job is
        ended by its timeout the report keeps it (the models phase calls this after each model)."""
        if ctx.is_main:
            part["phases"][name] = {"world_size": ctx.world_size, **result, "partial": True}
            write()

    args.save_partial = save_partial
    for name in args.phases:
        if args.smoke:
            # The phases call gc.collect() before each variant and timed round (free_memory, and to keep the
            # garbage of one variant out of the next one's timing). With torch and the package imported (and
            # after the first compile, dynamo's caches), each collection walked ~300,000 objects that live as
            # long as the process: 0.12-0.19 s a call, ~140 calls a rank at world 2 (22 s of its 49 s on
            # 2 CPU cores). What is alive between phases is frozen (`gc.freeze`) after one collection, so the
            # phases' collections look only at what they built since; on CPU no memory figure depends on it.
            import gc

            gc.collect()
            gc.freeze()
        t0 = time.perf_counter()
        if ctx.is_main:
            print(f"[suite] world {ctx.world_size}: phase {name}", flush=True)
        part["phases"][name] = {"world_size": ctx.world_size, **PHASES[name].module().run(ctx, args)}
        part["phase_seconds"][name] = time.perf_counter() - t0
        ctx.barrier()
        if ctx.is_main:  # after every phase, so a phase that dies leaves the earlier ones on file
            write()
    ctx.shutdown()


# ------------------------------------------------------------------------------------ orchestrator
def _worlds(args, top: int) -> list[int]:
    if args.worlds:
        worlds = sorted({int(w) for w in args.worlds.split(",")})
        if worlds[0] < 1 or worlds[-1] > top:
            raise SystemExit(f"--worlds {args.worlds}: each must be between 1 and {top} (the devices here)")
        return worlds
    worlds, w = [], 1
    while w < top:
        worlds.append(w)
        w *= 2
    return worlds + [top]


def _run_group(cmd: list[str], env: dict, timeout: float):
    """Run a world's launcher in a session of its own; its exit code, or "timeout" after `timeout` seconds,
    when the whole session (torchrun and its workers) is stopped: TERM, then KILL 10 s later. Killing
    torchrun alone left its workers running, holding the suite's output pipe open: a hung world then hung
    the caller (session 27's device call)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)  # workers that outlived the launcher too
        proc.wait()
        return "timeout"


# A smoke run whose orchestrator has torch imported already (the tests fork it from their warm server) may
# start its world jobs as forks of itself instead of fresh interpreters: DT_SUITE_FORK_WORKERS=1, --smoke only.
FORK_VAR = "DT_SUITE_FORK_WORKERS"


def _fork_group(cmd: list[str], world: int, env: dict, timeout: float):
    """`_run_group` for a smoke run's world job, with the job's ranks forked from this process (torch and the
    package imported once, not once per rank and launcher: ~3 s of CPU each on 2 cores) in place of
    ``python`` / ``torchrun``: a launcher in a session of its own forks `world` ranks, each with torchrun's
    variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; none at
    world 1, as a plain ``python``), which parse `cmd`'s own arguments (`_worker_command`'s) and run `worker`.
    A rank that fails stops the others, as torchrun does; past `timeout` the whole session is stopped."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    argv = cmd[cmd.index(str(HERE / "suite.py")) + 1:]
    sys.stdout.flush()
    sys.stderr.flush()
    launcher = fork.Process(target=_fork_launcher, args=(fork, argv, world, env), name="suite-launcher")
    launcher.start()
    launcher.join(timeout)
    if launcher.exitcode is not None:
        return launcher.exitcode
    _signal_group(launcher.pid, signal.SIGTERM)
    # The launcher itself, 10 s at most (its ranks hold its sentinel open, so not `join(10)`), as `_run_group`.
    deadline = time.monotonic() + 10
    while launcher.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_group(launcher.pid, signal.SIGKILL)  # ranks that outlived the launcher too
    launcher.join()
    return "timeout"


# What a process's first torch.compile (the compile phase, aot_eager) imports: ~1.3 s of CPU, paid once by
# the orchestrator before forking rather than by every rank. Imports only: no compiled code, no cache.
COMPILE_MODULES = ("torch._dynamo.backends.debugging", "torch._functorch.aot_autograd", "torch._inductor.compile_fx",
                   "torch._inductor.decomposition", "torch._inductor.lowering", "torch._export")


def _preload_for_forks(phases: list[str]) -> None:
    import importlib

    if "compile" in phases:
        for name in COMPILE_MODULES:
            importlib.import_module(name)


def _fork_launcher(fork, argv: list[str], world: int, env: dict) -> None:
    import socket
    from multiprocessing.connection import wait

    os.setsid()  # the session `_fork_group` stops on a timeout, the ranks in it
    os.environ.clear()
    os.environ.update(env)
    ranks_env = [{}]
    if world > 1:
        with socket.socket() as s:  # a free port for rank 0's store, as torchrun --standalone picks one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks_env = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                      "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(world)]
    ranks = [fork.Process(target=_fork_rank, args=(argv, e), name=f"suite-rank{i}") for i, e in enumerate(ranks_env)]
    for rank in ranks:
        rank.start()
    code = 0
    running = list(ranks)
    while running:
        for sentinel in wait([r.sentinel for r in running]):
            rank = next(r for r in running if r.sentinel == sentinel)
            rank.join()
            running.remove(rank)
            if rank.exitcode != 0 and code == 0:
                code = rank.exitcode if rank.exitcode > 0 else 1
                print(f"[suite] {rank.name} exited with {rank.exitcode}: stopping the others", file=sys.stderr,
                      flush=True)
                for other in running:
                    other.terminate()
    sys.exit(code)


def _fork_rank(argv: list[str], rank_env: dict) -> None:
    import torch

    os.environ.update(rank_env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    worker(parse_args(argv))


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group is gone already
        pass


def _worker_command(args, world: int, phases: list[str], part: Path) -> list[str]:
    launcher = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd = launcher + [str(HERE / "suite.py"), "--worker", "--part", str(part), "--phases", ",".join(phases),
                      "--accum", str(args.accum), "--models-profile", str(args.models_profile),
                      "--topk-ratio", str(args.topk_ratio)]
    if args.models:
        cmd += ["--models", ",".join(f"{m}:{b}:{s}" for m, b, s in args.models)]
    for flag, value in (("--smoke", args.smoke), ("--impls", args.impls), ("--rounds", args.rounds),
                        ("--steps", args.steps), ("--third-party", args.third_party), ("--variants", args.variants)):
        if value:
            cmd += [flag] if value is True else [flag, str(value)]
    return cmd


def run_all(args) -> int:
    import torch

    from common import environment

    gpus = 0 if args.smoke else torch.cuda.device_count()
    if not args.smoke and gpus == 0:
        raise SystemExit("no GPU here: use --smoke for the CPU run")
    if args.smoke:  # CPU processes on gloo: 2, or as many as --worlds asks (a phase's code at world 4, say)
        top = max([2, *(int(w) for w in args.worlds.split(",") if w.strip().isdigit())]) if args.worlds else 2
    else:
        top = min(gpus, args.max_gpus or gpus)
    worlds = _worlds(args, top)
    top = worlds[-1]
    env = environment()
    card = "cpu" if args.smoke else env["card"].replace("NVIDIA ", "").replace(" ", "-").lower()
    # A smoke run (CI, a first try) writes where git does not look; a GPU run where results are committed.
    default = HERE / "out" / "smoke" if args.smoke else HERE / "results" / f"{env['date']}-{card}"
    out = Path(args.out) if args.out else default
    out.mkdir(parents=True, exist_ok=True)
    results = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "smoke": args.smoke, **env, "world_sizes": worlds,
               "command": " ".join(sys.argv), "runs": [], "phases": {}}
    worker_phases = [p for p in args.phases if PHASES[p].worlds != "offline"]
    for name in worker_phases:
        results["phases"][name] = {"worlds": {}}
    failed = []
    for w in worlds:
        phases = [p for p in worker_phases if PHASES[p].runs_at(w, top)]
        if not phases:
            continue
        part = out / f"part_world{w}.json"
        part.unlink(missing_ok=True)
        cmd = _worker_command(args, w, phases, part)
        env_vars = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if args.smoke:
            env_vars.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        print(f"[suite] world {w}: {', '.join(phases)}", flush=True)
        t0 = time.perf_counter()
        timeout = args.timeout or (300 if args.smoke else 3600)
        if args.smoke and os.environ.get(FORK_VAR) == "1":
            _preload_for_forks(phases)
            code = _fork_group(cmd, w, env_vars, timeout)
        else:
            code = _run_group(cmd, env_vars, timeout)
        got = json.loads(part.read_text()) if part.is_file() else {"phases": {}}
        part.unlink(missing_ok=True)
        results["runs"].append({k: v for k, v in got.items() if k != "phases"} |
                               {"world_size": w, "phases": phases, "seconds": time.perf_counter() - t0,
                                "exit": code})
        for name in phases:
            results["phases"][name]["worlds"][str(w)] = got["phases"].get(
                name, {"world_size": w, "status": "error", "reason": f"the world-{w} job ended ({code}) before it "
                                                                      "finished this phase: see its output"})
        if code != 0:
            failed.append(w)
    for name in worker_phases:
        entry = results["phases"][name]
        statuses = {r.get("status") for r in entry["worlds"].values()}
        if not entry["worlds"]:
            entry.update(status="skipped", reason=f"runs at world sizes '{PHASES[name].worlds}'; this run had "
                                                  f"{', '.join(map(str, worlds))}")
        elif "error" in statuses:
            entry["status"] = "error"
        elif statuses == {"skipped"}:
            entry.update(status="skipped", reason="; ".join(sorted({r["reason"] for r in entry["worlds"].values()})))
        else:
            entry["status"] = "ok"
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report(out, args)
    if failed:
        print(f"[suite] the job at world size(s) {failed} failed: see the output above", file=sys.stderr)
        return 1
    return 0


def merge(sources: list[str], out: Path, args) -> None:
    """Merge results of suite runs made in parts (a device call is limited in time) into `out`/results.json.

    Every part must come from the same card, torch and NCCL: figures are only comparable within one
    machine. Phases and worlds are united; the parts' commands and runs are all kept."""
    parts = []
    for source in sources:
        path = Path(source)
        path = path / "results.json" if path.is_dir() else path
        parts.append(json.loads(path.read_text()))
    keys = ("card", "torch", "nccl", "driver")
    first = parts[0]
    for source, part in zip(sources[1:], parts[1:]):
        differs = [k for k in keys if part.get(k) != first.get(k)]
        if differs:
            raise SystemExit(f"--merge: {source} differs from {sources[0]} in {', '.join(differs)}: "
                             "results of different machines cannot be merged")
    # A part that is itself a merge holds lists (of creation times, of argument lists): joined, not nested.
    created = [c for p in parts for c in (p["created"] if isinstance(p["created"], list) else [p["created"]])]
    commands = [c for p in parts for c in (p["command"] if p["command"] and isinstance(p["command"][0], list)
                                           else [p["command"]])]
    merged = {**first, "command": commands, "created": created,
              "world_sizes": sorted({w for p in parts for w in p["world_sizes"]}),
              "runs": [r for p in parts for r in p["runs"]], "phases": {}}
    for part in parts:
        for name, entry in part["phases"].items():
            if PHASES.get(name) is not None and PHASES[name].worlds == "offline":
                continue  # redone by the report on the merged figures
            target = merged["phases"].setdefault(name, {"worlds": {}})
            target["worlds"].update(entry.get("worlds", {}))
            for key, value in entry.items():
                if key != "worlds":
                    target[key] = value
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(merged, indent=1, default=str))
    report(out, args)


def report(folder: Path, args) -> None:
    """Run the offline phases on `folder`/results.json, then write results.md and the plots."""
    from report import plots, render_markdown

    results = json.loads((folder / "results.json").read_text())
    for name in args.phases:
        if PHASES[name].worlds == "offline":
            try:
                results["phases"][name] = PHASES[name].module().run(results, args)
            except Exception:  # noqa: BLE001 - recorded, so the measurements are still written
                results["phases"][name] = {"status": "error", "reason": traceback.format_exc(limit=4)}
    (folder / "results.json").write_text(json.dumps(results, indent=1, default=str))
    md = render_markdown(results)
    (folder / "results.md").write_text(md)
    print(md)
    try:
        written = plots(results, folder)
        print(f"[suite] plots: {', '.join(written) or 'none'}")
    except ImportError:
        print("[suite] matplotlib is not installed: no plots (run --report on a machine that has it)")
    print(f"[suite] results in {folder}")


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    elif a.report:
        report(Path(a.report), a)
    elif a.merge:
        if not a.out:
            raise SystemExit("--merge needs --out (the folder for the merged results)")
        merge(a.merge, Path(a.out), a)
    else:
        sys.exit(run_all(a))
