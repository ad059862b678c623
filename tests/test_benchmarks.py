"""The benchmark suite (`benchmarks/suite.py`): its CPU smoke mode runs every phase end to end on gloo
with 2 processes and records what each phase promises; phases that cannot run record why; the one
calibration of the scaling model reproduces the recorded model check the README quotes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from _bench import ENV, REPO, SUITE, _check_ps_recommender, _suite

ALL_PHASES = {"collectives", "training", "models", "images", "accuracy", "precision", "topk", "profiling", "monitor", "checkpoint", "memory",
              "compile",
              "pipeline", "pipeline_trainer", "tensor", "ps", "imagenet_projection", "model_check"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_runs_every_phase(tmp_path, warm_python):
    import shutil
    import tempfile

    shutil.rmtree(Path(tempfile.gettempdir()) / "dt-suite-images-64x40", ignore_errors=True)  # written afresh
    results = _suite(tmp_path, timeout=540, warm_python=warm_python)
    assert results["smoke"] and results["card"] == "cpu" and results["world_sizes"] == [1, 2]
    assert {"torch", "nccl", "cuda", "python"} <= set(results)
    assert [r["world_size"] for r in results["runs"]] == [1, 2]
    for run in results["runs"]:  # every job records its machine and world size, and ran to the end
        assert run["exit"] == 0 and run["card"] == "cpu" and run["backend"] == "gloo" and "torch" in run, run
    assert set(results["phases"]) == ALL_PHASES
    not_ok = {name: p for name, p in results["phases"].items() if p["status"] != "ok"}
    assert not not_ok, json.dumps(not_ok, indent=1)[-4000:]
    ph = results["phases"]

    # Collectives at world 2 only: every op at every size, a finite time, the overlap in [0, 1].
    assert set(ph["collectives"]["worlds"]) == {"2"}
    coll = ph["collectives"]["worlds"]["2"]
    ops = {r["op"] for r in coll["rows"]}
    assert ops == {"nccl_all_reduce", "ring_all_reduce", "tree_all_reduce", "hierarchical_all_reduce",
                   "hierarchical_2node_all_reduce", "all_gather", "reduce_scatter", "topk_reduce", "bf16_reduce",
                   "powersgd_reduce"}
    assert len(coll["rows"]) == len(ops) * len({r["bytes"] for r in coll["rows"]}) >= 2 * len(ops)
    assert all(r["seconds"] > 0 and r["world"] == 2 for r in coll["rows"])
    # The segment sweep at the largest size: the ring at each segment x depth and by default, the tree, the ceiling.
    sweep = coll["sweep"]
    assert [r["op"] for r in sweep].count("ring") == 7 and [r["op"] for r in sweep].count("tree") == 4
    assert sweep[-1]["op"] == "p2p_exchange" and all(r["seconds"] > 0 and r["vs_nccl"] > 0 for r in sweep)
    assert {r["bytes"] for r in sweep} == {max(r["bytes"] for r in coll["rows"])}
    assert 0.0 <= coll["overlap"]["efficiency"] <= 1.0

    # Training: the 1-rank baseline and overheads; at 2 ranks ours vs torch's, interleaved in one job.
    one = ph["training"]["worlds"]["1"]["models"]["tiny"]
    assert set(one["phases"]) == {"plain", "ours_ddp", "zero1", "zero2", "zero3", "ddp_bf16", "ddp_topk",
                                  "ddp_powersgd"}
    assert {"forward_s", "backward_s", "optimizer_s", "params", "units", "largest_unit_params"} <= set(one["profile"])
    two = ph["training"]["worlds"]["2"]["models"]["tiny"]
    assert set(two["phases"]) == {"solo", "torch_ddp", "torch_ddp_gav", "ours_ddp", "zero1", "zero2", "zero3",
                                  "torch_fsdp2", "ddp_bf16", "ddp_topk", "ddp_powersgd", "torch_ddp_nosync",
                                  "ours_ddp_nosync"}
    for impl, p in two["phases"].items():
        assert p["step_s"] > 0 and math.isfinite(p["last_loss"]) or impl == "solo", (impl, p)
    assert two["phases"]["ddp_topk"]["bytes_sent_per_step"] < two["phases"]["ddp_bf16"]["bytes_sent_per_step"]
    assert two["phases"]["ddp_bf16"]["bytes_sent_per_step"] < two["phases"]["ours_ddp"].get("bytes_sent_per_step",
                                                                                              math.inf)
    assert set(two["exposed_comm_s"]) == {"torch_ddp", "ours_ddp"}
    assert two["ours_comm_only"]["step_s"] > 0 and two["ours_comm_only"]["gradient_bytes"] == 4 * two["params"]
    # The planner's formula: ZeRO-3 holds less model state per rank than ZeRO-2, ZeRO-2 than DDP.
    f = {i: two["phases"][i]["model_state_formula_gib"] for i in ("ours_ddp", "zero2", "zero3")}
    assert f["zero3"] < f["zero2"] < f["ours_ddp"]

    # Third-party models: the smoke run's torch-only model, every default variant, relative to torch DDP.
    models = ph["models"]["worlds"]["2"]
    toy = models["models"]["toy_cnn"]
    assert set(toy["step_ms_median"]) == set(models["variants"]) == {"plain", "torch", "ours", "trainer",
                                                                       "trainer_monitor", "ours_nosync"}
    assert toy["speed_vs_torch"]["torch"] == 1.0 and all(t > 0 for t in toy["step_ms_median"].values())

    _check_images(ph["images"], fresh=True)
    _check_projection(ph["imagenet_projection"], ph["images"])
    # Time to accuracy through dtrain's job: the smoke target (0.5) is reached within its 2 epochs at both worlds.
    for w, part in ph["accuracy"]["worlds"].items():
        r = part["recipes"]["recipe"]
        assert r["reached"] and 0 < r["time_to_target_s"] < r["job_s"] and r["val_accuracy"] >= 0.5, (w, r)
        assert r["target_step"] % r["config"]["evaluation"]["every"] == 0  # at an epoch's evaluation
    md = (tmp_path / "results.md").read_text()
    assert "## Image classifiers" in md and "| resnet18 | 2 |" in md and "| vit_tiny | 1 |" in md

    # Precision: three curves from the same seed; fp32 is the reference.
    prec = ph["precision"]["worlds"]["2"]["precisions"]
    assert set(prec) == {"fp32", "bf16", "fp16"} and prec["fp32"]["max_abs_loss_diff_vs_fp32"] == 0.0
    assert all(math.isfinite(p["max_abs_loss_diff_vs_fp32"]) and p["step_s"] > 0 for p in prec.values())
    assert prec["fp16"]["final_loss_scale"] > 0

    topk = ph["topk"]["worlds"]["1"]
    assert set(ph["topk"]["worlds"]) == {"1"} and topk["buckets"] and topk["step_ms"]
    assert all(set(row) >= {"blockmax", "exact", "chunked", "sampled"} for row in [*topk["buckets"].values(),
                                                                                   *topk["step_ms"].values()])
    assert len(topk["step_ms_by_bucket"]) == 2 and set(topk["powersgd"]["buckets"]) == set(topk["buckets"])
    assert all(v > 0 for models in topk["powersgd"]["step_ms_by_bucket"].values() for v in models.values())

    prof = ph["profiling"]["worlds"]["2"]["report"]
    assert set(prof) == {"plain", "ours_nosync", "ours", "torch"}
    assert all(r["ms_by_category"].get("matmul", 0) > 0 for r in prof.values())
    assert prof["ours"]["ms_by_category"].get("comm", 0) > 0 and prof["torch"]["ms_by_category"].get("comm", 0) > 0

    # The monitor at every world: paired rounds, and what the monitored trainer wrote is whole.
    assert set(ph["monitor"]["worlds"]) == {"1", "2"}
    for mon in ph["monitor"]["worlds"].values():
        assert math.isfinite(mon["monitor_overhead_pct"]) and mon["event_files"] and mon["records"]["ok"], mon
        assert len(mon["paired_overhead_pct"]) == mon["rounds"] and mon["at_most_1pct"]
    assert ph["monitor"]["worlds"]["2"]["records"]["cluster_view_on_rank0"] is True

    # Checkpoints every N steps, synchronous vs in the background: paired figures, the same checkpoints written.
    assert set(ph["checkpoint"]["worlds"]) == {"1", "2"}
    for ck in ph["checkpoint"]["worlds"].values():
        assert all(math.isfinite(ck[f"{m}_overhead_pct"]) for m in ("sync", "async")), ck
        assert len(ck["async_paired_overhead_pct"]) == ck["rounds"] and ck["async_below_1pct"], ck
        assert ck["latest_steps"]["sync"] == ck["latest_steps"]["async"] and ck["rank0_file_mb"] > 0, ck

    # Memory at the largest world: checkpointing off and on, then batch_size="auto" trains without running out.
    assert set(ph["memory"]["worlds"]) == {"2"}
    memory = ph["memory"]["worlds"]["2"]
    assert set(memory["checkpointing"]) == {"off", "on"}
    assert all(r["step_ms"] > 0 and math.isfinite(r["rank0_loss"]) for r in memory["checkpointing"].values())
    auto = memory["auto_batch"]
    assert auto["batch_size"] >= 1 and auto["no_oom"] and auto["loss_finite"] and auto["reason"], auto

    # Pipeline at world 2: our schedules and torch's, each run recorded (ZB-H1 may still say why it did not run).
    pipe = ph["pipeline"]["worlds"]["2"]
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        for impl in ("ours", "torch"):
            run = pipe["runs"][f"{impl}_{schedule}"]
            assert run["status"] == "ok" and run["step_ms"] > 0, (impl, schedule, run)
        assert 0 < pipe["runs"][f"ours_{schedule}"]["bubble_formula"] < 1
    assert {"ours_zbh1", "torch_zbh1"} <= set(pipe["runs"])

    # Tensor parallelism at world 2: ours and torch's DTensor TP at T=2, with and without SP, from the same
    # weights on the same batches: both run, and their losses agree (fp32 on CPU).
    tensor = ph["tensor"]["worlds"]["2"]
    assert set(tensor["configs"]) == {"TP2 no SP", "TP2 SP"}
    for name, row in tensor["configs"].items():
        for impl in ("ours", "torch"):
            assert row[impl]["status"] == "ok" and row[impl]["step_s"] > 0, (name, impl, row[impl])
        assert row["max_abs_loss_diff"] < 1e-4 and row["speed_vs_torch"] > 0, (name, row)

    # The parameter server at world 2 (one server, one worker): fewer bytes than DDP's dense all-reduce of
    # the tables; the digits comparison needs a third rank and says so (its own test runs world 3).
    assert set(ph["ps"]["worlds"]) == {"2"}
    _check_ps_recommender(ph["ps"]["worlds"]["2"]["recommender"], 2)
    assert ph["ps"]["worlds"]["2"]["consistency"]["status"] == "skipped"

    # The scaling model: calibrated once from this run, every multi-GPU strategy predicted, projected.
    mc = ph["model_check"]
    this = mc["this_run"]
    assert this["status"] == "ok" and this["link"]["world"] == 2, this
    assert {c["strategy"] for c in this["checks"]} == {"ours_ddp", "zero1", "zero2", "zero3", "ddp_bf16", "ddp_topk",
                                                      "ddp_powersgd"}
    assert all(math.isfinite(c["error"]) for c in this["checks"])
    rows = this["projections"]["models"]["tiny"]
    assert [r["gpus"] for r in rows] == [1, 2, 8, 16, 32, 64, 128, 256] and all(r["choice"] for r in rows)
    assert len(mc["ddp_runs"]["this run"]["rows"]) == 1
    recorded = [v for k, v in mc["ddp_runs"].items() if k.endswith("ddp_2026-11-26_h200.json")]
    assert len(recorded) == 1 and len(recorded[0]["rows"]) == 3

    md = (tmp_path / "results.md").read_text()
    for heading in ("## Collectives, 2 ranks", "## Training (GPT)", "## Parameter server, world 2", "## Third-party models, 2 GPUs", "## Image classifiers", "## Precision",
                    "## Top-K selection", "## Profile of a DDP step", "## Monitor overhead", "## Memory (", "## Pipeline (", "## Tensor parallelism, 2 GPUs",
                    "## Projections (model output, not measurements)", "Largest error"):
        assert heading in md, heading
    pytest.importorskip("matplotlib")
    for png in ("collectives_world2.png", "projection_tiny.png", "model_vs_measured.png", "ddp_check_this_run.png",
                "ddp_projection_ddp_2026-11-26_h200.png"):
        assert (tmp_path / png).is_file(), png


def _check_images(images, fresh: bool = False):
    """The images phase at worlds 1 and 2: every variant of both smoke models timed; torch's DDP and ours,
    from the same weights on the same batches, end on the same loss (fp32 on CPU); the JPEG folder was
    written once (by the world-1 job when `fresh`: an earlier run's is reused) and its decode rate measured."""
    assert images["status"] == "ok" and set(images["worlds"]) == {"1", "2"}
    for w, part in images["worlds"].items():
        assert part["variants"] == ["torch", "ours", "ours_folder", "ours_nosync"]
        assert set(part["models"]) == {"resnet18", "vit_tiny"}
        assert ("link" in part) == (w == "2")  # the all-reduce sweep the projection calibrates from
        assert (part["folder"]["write_s"] > 0) == (fresh and w == "1") and part["folder"]["jpegs"] == 64, part["folder"]
        for name, m in part["models"].items():
            # ours_nosync at world 2 only (at one GPU our DDP sends nothing anyway)
            assert set(m["images_per_s_per_gpu"]) == set(part["variants"]) - ({"ours_nosync"} if w == "1" else set()), (w, name)
            assert all(x > 0 and math.isfinite(x) for x in m["images_per_s_per_gpu"].values()), (w, name, m)
            assert m["vs_torch"]["torch"] == 1.0 and len(m["step_ms_rounds"]["ours"]) == part["rounds"]
            loss = m["last_loss_rank0"]
            assert math.isfinite(loss["ours_folder"]) and loss["ours"] == pytest.approx(loss["torch"], rel=1e-4), loss
            assert m["grads_unlike_params"]["torch"] == 0  # torch's DDP keeps each gradient laid out like its weight
            inp = m["input"]
            assert inp["decoded_images_per_s_per_process"] > 0 and inp["workers_per_rank"] == 1, inp
            assert inp["folder_vs_synthetic"] > 0 and isinstance(inp["input_bound"], bool), inp


def _check_projection(projection, images):
    """The ImageNet projection: calibrated from the images phase's world-1 step, its world-2 no_sync
    step and all-reduce sweep; each measured world-2 step predicted from both computes; 8-256 GPUs."""
    two = images["worlds"]["2"]["models"]["resnet18"]
    assert projection["status"] == "ok" and projection["label"] == "projection" and projection["model"] == "resnet18"
    assert sorted(projection["compute_s"].values()) == pytest.approx(sorted(
        [images["worlds"]["1"]["models"]["resnet18"]["step_ms_median"]["ours"] / 1e3,
         two["step_ms_median"]["ours_nosync"] / 1e3]))
    assert [c["world"] for c in projection["checks"]] == [2, 2]
    assert all(c["measured_s"] == pytest.approx(two["step_ms_median"]["ours"] / 1e3) for c in projection["checks"])
    rows = projection["rows"]
    assert [r["gpus"] for r in rows] == [8, 16, 32, 64, 128, 256] and [r["nodes"] for r in rows] == [1, 2, 4, 8, 16, 32]
    for r in rows:
        assert r["epoch_s"] == pytest.approx(1_281_167 / r["images_per_s"])
        assert 0 < r["efficiency_vs_loaded_gpu"] <= 1 and r["exposed_s"] >= 0
        # anchored at the world-2 step measured: the model's ratio carried onto it
        assert r["anchored_step_s"] / r["step_s"] == pytest.approx(
            rows[0]["anchored_step_s"] / rows[0]["step_s"]) and projection["anchor_world"] == 2


@pytest.mark.timeout(120)
def test_a_phase_that_cannot_run_records_why(tmp_path, warm_python):
    """At world 1 alone there is nothing to all-reduce: collectives are skipped, with the reason, and the
    model check on this run says what it lacks (no job is started at all)."""
    results = _suite(tmp_path, "--worlds", "1", "--phases", "collectives,model_check", "--recorded", timeout=100,
                     warm_python=warm_python)
    coll = results["phases"]["collectives"]
    assert coll["status"] == "skipped" and "multi" in coll["reason"] and coll["worlds"] == {}
    assert results["runs"] == []
    mc = results["phases"]["model_check"]
    assert mc["status"] == "ok" and mc["this_run"]["status"] == "skipped"
    assert "collectives" in mc["this_run"]["reason"] and mc["ddp_runs"] == {"this run": {"rows": [], "projection": []}}
    assert "collectives: **skipped**" in (tmp_path / "results.md").read_text()


def test_one_calibration_reproduces_the_recorded_model_check():
    """`calibration.calibrate`, through the model check phase, gives exactly the figures of the committed
    benchmarks/results/model_check_2026-11-26_h200.json (the README's scaling-model tables)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from phases.model_check import _ddp_points_from_recorded, check_points

    runs = json.loads((REPO / "benchmarks/results/ddp_2026-11-26_h200.json").read_text())["runs"]
    rows, projection = check_points([p for run in runs for p in _ddp_points_from_recorded(run)])
    recorded = json.loads((REPO / "benchmarks/results/model_check_2026-11-26_h200.json").read_text())
    assert len(rows) == len(recorded["rows"]) == 3
    for new, old in zip(rows, recorded["rows"]):
        for key, value in old.items():
            assert new[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key
    assert len(projection) == len(recorded["projection"]["rows"])
    for new, old in zip(projection, recorded["projection"]["rows"]):
        for key, value in old.items():
            assert new[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key


def test_bad_arguments_are_named():
    out = subprocess.run([sys.executable, str(SUITE), "--smoke", "--phases", "training,nonsense"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "nonsense" in out.stderr and "collectives" in out.stderr


def test_help_describes_every_phase():
    """`suite.py --help` described 13 of the 18 phases (accuracy, pipeline, compile, pipeline_trainer and
    imagenet_projection were missing from its list)."""
    out = subprocess.run([sys.executable, str(SUITE), "--help"], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    described = {line.split()[0] for line in out.stdout.split("Phases (")[1].split("\n\n")[1].splitlines()}
    assert described == ALL_PHASES


@pytest.mark.timeout(60)
def test_a_world_past_its_timeout_is_stopped_with_every_process_it_started(tmp_path):
    """`suite._run_group`: a launcher past its time is stopped together with the processes it started (a
    hung torchrun's workers kept the suite's output pipe open, so a device call waited past its limit)."""
    import os
    import time

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from suite import _run_group
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    marker = tmp_path / "child.pid"
    # The launcher starts a child that ignores TERM and outlives it, as a stuck worker would.
    script = (f"import os, signal, subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              f"signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
              f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
              f"time.sleep(300)\n")
    t0 = time.monotonic()
    assert _run_group([sys.executable, "-c", script], dict(os.environ), timeout=3) == "timeout"
    assert time.monotonic() - t0 < 30
    pid = int(marker.read_text())
    for _ in range(50):  # reaped by init once killed; gone from the process table soon after
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launcher's child {pid} is still running")
    assert _run_group([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), timeout=10) == 3


@pytest.mark.timeout(90)
def test_a_forked_world_past_its_timeout_is_stopped_with_every_rank(tmp_path, warm_python):
    """`suite._fork_group` (how the tests' smoke runs start a world: its ranks forked from the orchestrator,
    DT_SUITE_FORK_WORKERS=1): ranks that hang past the timeout, ignoring TERM, are stopped with their
    launcher; a rank that fails stops the others and fails the world with its exit code."""
    import time

    script = (f"import os, signal, sys, time\n"
              f"sys.path.insert(0, {str(REPO / 'benchmarks')!r})\n"
              f"import suite\n"
              f"def hang(args):\n"
              f"    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"    open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
              f"    time.sleep(300)\n"
              f"def fail(args):\n"
              f"    if os.environ['RANK'] == '1':\n"
              f"        raise SystemExit(3)\n"
              f"    time.sleep(300)\n"
              f"cmd = [sys.executable, str(suite.HERE / 'suite.py'), '--worker', '--smoke']\n"
              f"suite.worker = hang\n"
              f"t0 = time.monotonic()\n"
              f"assert suite._fork_group(cmd, 2, dict(os.environ), timeout=3) == 'timeout'\n"
              f"assert time.monotonic() - t0 < 20, time.monotonic() - t0\n"
              f"suite.worker = fail\n"
              f"t0 = time.monotonic()\n"
              f"assert suite._fork_group(cmd, 2, dict(os.environ), timeout=60) == 3\n"
              f"assert time.monotonic() - t0 < 20, time.monotonic() - t0\n")
    out = warm_python(["-c", script], cwd=REPO, env=ENV, timeout=80)
    assert out.returncode == 0, out.stdout + out.stderr
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    for _ in range(50):  # killed; reaped by init, then gone from the process table (or a zombie till then)
        alive = [pid for pid in pids if Path(f"/proc/{pid}/stat").is_file()
                 and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
        if not alive:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hung ranks {alive} are still running")


def test_an_overhead_verdict_needs_rounds_and_an_interval_that_can_be():
    """The monitor phase said "<= 1%: yes" from 2 rounds whose "95% interval" (their range) was -21% to -12%:
    a monitor cannot make a step faster, so the noise was larger than the effect (trial B, session 50)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import one_percent_verdict

    assert one_percent_verdict(-21.2, -11.9, 2).startswith("undecided (2 rounds")
    assert one_percent_verdict(-21.2, -11.9, 10).startswith("undecided (the interval")
    assert one_percent_verdict(-0.4, 0.7, 10) == "yes"
    assert one_percent_verdict(1.2, 3.0, 10) == "no"
    assert one_percent_verdict(0.5, 1.5, 10).startswith("undecided (the interval holds")
