"""The benchmark suite (`benchmarks/suite.py`): its CPU smoke mode runs every phase end to end on gloo
with 2 processes and records what each phase promises; phases that cannot run record why; the one
calibration of the scaling model reproduces the recorded model check the README quotes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "suite.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
ALL_PHASES = {"collectives", "training", "models", "images", "accuracy", "precision", "topk", "profiling", "monitor", "checkpoint", "memory",
              "compile",
              "pipeline", "pipeline_trainer", "tensor", "ps", "imagenet_projection", "model_check"}


def _suite(tmp_path, *args, timeout):
    out = subprocess.run([sys.executable, str(SUITE), "--smoke", "--out", str(tmp_path), *args], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_runs_every_phase(tmp_path):
    import shutil
    import tempfile

    shutil.rmtree(Path(tempfile.gettempdir()) / "dt-suite-images-64x40", ignore_errors=True)  # written afresh
    results = _suite(tmp_path, timeout=540)
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


def _check_ps_recommender(rec, world):
    """The ps phase's recommender at `world`: DDP and sync PS with 1 .. min(4, world - 1) servers, from the
    same weights on the same batches; the PS moves only touched rows (fewer bytes than DDP's gradient), every
    server count makes the same updates (the same loss at every step), every variant reaches the target."""
    variants = rec["variants"]
    assert list(variants) == ["ddp"] + [f"ps_s{s}" for s in range(1, min(4, world - 1) + 1)]
    assert all(rec["global_batch"] % v["workers"] == 0 for v in variants.values())
    ddp = variants["ddp"]
    assert ddp["workers"] == world and ddp["gradient_bytes_per_step"] == 4 * ddp["params"]
    assert rec["bayes_loss"] < rec["target_loss"] < rec["initial_loss"], rec
    for name, v in variants.items():
        assert v["finite"] and v["step_ms_median"] > 0 and v["reached"] and v["time_to_loss_s"] > 0, (name, v)
        assert v["final_loss_ema"] < rec["initial_loss"] - 0.02, (name, v["final_loss_ema"])  # it learns
        if name == "ddp":
            continue
        assert v["servers"] + v["workers"] == world and len(v["server_bytes_per_step"]) == v["servers"]
        assert 0 < v["bytes_per_step_per_worker"] < ddp["gradient_bytes_per_step"] and v["bytes_vs_ddp"] < 1, v
        assert v["push_bytes_per_step"] > 0 and v["pull_bytes_per_step"] > 0 and v["index_bytes_per_step"] > 0
        assert v["max_staleness"] == 0 and v["updates"] == [rec["steps"]] * v["servers"]  # sync: one update a step
        assert v["server_max_over_mean"] >= 1 and v["plan_max_over_mean"] >= 1
        assert v["max_loss_diff_vs_ps_s1"] < 1e-5, (name, v["max_loss_diff_vs_ps_s1"])
        assert v["max_loss_diff_vs_ddp"] < 0.05  # lazy vs dense Adam on the tables: close, not equal


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_phase_at_world_3_compares_sync_ssp_and_async(tmp_path):
    """The ps phase at world 3: the recommender with one and two servers; on the digits one server and two
    workers, the second slow: every mode reaches 0.9, sync measures no staleness, ssp at most its bound
    (and some: the fast worker ran ahead), async one update per gradient."""
    results = _suite(tmp_path, "--phases", "ps", "--worlds", "3", timeout=280)
    part = results["phases"]["ps"]["worlds"]["3"]
    assert part["status"] == "ok", part.get("reason")
    _check_ps_recommender(part["recommender"], 3)
    cons = part["consistency"]
    assert cons["status"] == "ok" and cons["workers"] == 2 and cons["slow_worker"] == 1
    modes = cons["modes"]
    assert list(modes) == ["sync", "ssp", "async"]
    steps = cons["steps_per_worker"]
    for mode, m in modes.items():
        assert m["reached"] and 0 < m["time_to_accuracy_s"] < max(m["wall_s_per_worker"]), (mode, m)
        assert m["final_accuracy"] >= 0.85, (mode, m)
    assert modes["sync"]["max_staleness"] == 0 and modes["sync"]["updates"] == steps
    assert 1 <= modes["ssp"]["max_staleness"] <= 2 and modes["ssp"]["updates"] == steps
    assert modes["async"]["updates"] == 2 * steps and modes["async"]["pulls_delayed"] == 0
    # The rotating straggler: the same bounds; sync waits for someone's sleep every step, ssp and async do
    # not, so they finish sooner (every worker sleeps in half of its steps; sync's wall is at least all of
    # them). Only what the delay alone forces is asserted: timings on shared cores are noisy.
    rotating = cons["rotating"]
    assert all(m["reached"] for m in rotating.values()), rotating
    assert rotating["sync"]["max_staleness"] == 0 and rotating["ssp"]["max_staleness"] <= 2
    assert min(rotating["sync"]["wall_s_per_worker"]) >= steps * cons["delay_s"]
    md = (tmp_path / "results.md").read_text()
    assert "## Parameter server, world 3" in md and "| one slow | ssp s=2 |" in md and "| rotating | async |" in md
    assert "| ps_s2 | 2 x 1 |" in md


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pipeline_phase_at_world_4_with_data_parallel_pipelines_balanced_by_time(tmp_path):
    """The pipeline phase at world 4 (gloo): P = 4 and P = 2 x DP = 2, every schedule of ours and torch's,
    stages balanced by measured time. Same initial weights and global batch everywhere, so every run's
    last loss is the same: the two pipelines of P = 2 x DP = 2 see different halves of the batch (their
    own losses differ), and only the average of their gradients over the data groups keeps them on
    P = 4's trajectory (without it their mean loss moves off by about 6e-3 here)."""
    from distributed_training.pipeline import bubble_formula, partition

    results = _suite(tmp_path, "--phases", "pipeline", "--worlds", "4", "--variants", "time", timeout=400)
    pipe = results["phases"]["pipeline"]["worlds"]["4"]
    assert pipe["status"] == "ok" and pipe["balances"] == ["time"], pipe.get("reason")
    assert list(pipe["configs"]) == ["P4 time", "P2xDP2 time"]
    dp = pipe["configs"]["P2xDP2 time"]
    assert (dp["pipeline"], dp["data"], dp["microbatch_sequences"]) == (2, 2, 1)
    costs = pipe["layer_costs"]["time"]  # embed, 16 blocks, head: seconds, each measured
    assert len(costs) == 18 and all(c > 0 for c in costs)
    reference = pipe["runs"]["ours_1f1b"]["last_loss"]  # the first configuration's keys carry no prefix
    for prefix, P in (("", 4), ("P2xDP2 time ", 2)):
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbh1"):
            for impl in ("ours", "torch"):
                run = pipe["runs"][f"{prefix}{impl}_{schedule}"]
                assert run["status"] == "ok" and run["step_ms"] > 0, (prefix, impl, schedule, run)
                assert (run["pipeline"], run["data"], run["balance"]) == (P, 4 // P, "time")
                # Cut by the measured times.
                assert run["bounds"] == partition(costs, P * run["chunks_per_rank"]), (prefix, impl, schedule)
                assert run["last_loss"] == pytest.approx(reference, rel=1e-5), (prefix, impl, schedule)
                assert len(run["last_loss_per_pipeline"]) == 4 // P
            ours = pipe["runs"][f"{prefix}ours_{schedule}"]
            assert ours["bubble_formula"] == pytest.approx(bubble_formula(schedule, P, 4, chunks=ours["chunks_per_rank"]))
            assert 0 <= ours["bubble_measured"] < 1 and len(ours["bubble_measured_per_pipeline"]) == 4 // P
            assert len(ours["forward_ms_per_rank"]) == 4
    halves = pipe["runs"]["P2xDP2 time ours_1f1b"]["last_loss_per_pipeline"]
    assert abs(halves[0] - halves[1]) > 1e-4  # different data: the agreement above is not a coincidence
    md = (tmp_path / "results.md").read_text()
    assert "| P2xDP2 time | 1f1b |" in md and "Balance by time:" in md


@pytest.mark.timeout(120)
def test_a_phase_that_cannot_run_records_why(tmp_path):
    """At world 1 alone there is nothing to all-reduce: collectives are skipped, with the reason, and the
    model check on this run says what it lacks (no job is started at all)."""
    results = _suite(tmp_path, "--worlds", "1", "--phases", "collectives,model_check", "--recorded", timeout=100)
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
