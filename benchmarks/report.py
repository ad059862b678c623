"""The suite's report: ``results.md`` (one section per phase that ran) and PNG plots, from results.json."""

from __future__ import annotations

import re
from pathlib import Path

from common import MB, save_figure


def _size(b: int) -> str:
    return f"{b // MB} MB" if b >= MB else f"{b // 1024} KB"


def _ok_worlds(results: dict, phase: str) -> list[tuple[int, dict]]:
    worlds = results["phases"].get(phase, {}).get("worlds", {})
    return sorted(((int(w), r) for w, r in worlds.items() if r.get("status") == "ok"), key=lambda kv: kv[0])


def render_markdown(results: dict) -> str:
    card = results["card"]
    lines = [f"# Benchmark suite: {card}{' (CPU smoke run: not a performance figure)' if results.get('smoke') else ''}",
             "", f"torch {results['torch']}, CUDA {results.get('cuda')}, NCCL {results.get('nccl')}, driver "
             f"{results.get('driver')}, Python {results['python']}; world sizes "
             f"{', '.join(map(str, results['world_sizes']))}; {results['created']}. Training figures are the median "
             "over interleaved rounds, the slowest rank's.", ""]
    for name, entry in results["phases"].items():
        for w, r in sorted(entry.get("worlds", {}).items()):
            if r.get("status") != "ok":
                lines.append(f"- {name}, world {w}: **{r.get('status')}**: {r.get('reason', '').strip()}")
            elif r.get("partial"):
                lines.append(f"- {name}, world {w}: **partial**: the job ended before the phase finished; "
                             "what it had finished is shown")
        if entry.get("status") in ("skipped", "error") and entry.get("reason") and not entry.get("worlds"):
            lines.append(f"- {name}: **{entry['status']}**: {entry['reason'].strip()}")
    lines.append("")
    for section in (_collectives, _training, _compile, _models, _images, _accuracy, _precision, _topk, _profiling, _monitor, _checkpoint, _memory,
                    _pipeline,
                    _pipeline_big, _tensor, _ps, _imagenet_projection, _model_check):
        lines += section(results)
    return "\n".join(lines) + "\n"


def _collectives(results):
    lines = []
    for w, part in _ok_worlds(results, "collectives"):
        rows = part["rows"]
        sizes = sorted({r["bytes"] for r in rows})
        ops = list(dict.fromkeys(r["op"] for r in rows))
        table = {(r["op"], r["bytes"]): r for r in rows}
        lines += [f"## Collectives, {w} ranks: bus bandwidth GB/s ({'gloo' if results.get('smoke') else 'NCCL'}'s all-reduce "
                  "time / ours at the largest size)",
                  "", "| op | " + " | ".join(_size(s) for s in sizes) + " | at largest vs NCCL |",
                  "|---" * (len(sizes) + 2) + "|"]
        ref = table[("nccl_all_reduce", sizes[-1])]["seconds"]
        for op in ops:
            vs = f"{ref / table[(op, sizes[-1])]['seconds']:.2f}x" if op.endswith("_reduce") else ""
            lines.append(f"| {op} | " + " | ".join(f"{table[(op, s)]['busbw_gbs']:.2f}" for s in sizes) + f" | {vs} |")
        sweep = part.get("sweep")
        if sweep:
            lines += ["", f"Segment sweep at {_size(sweep[0]['bytes'])}: bus bandwidth GB/s and NCCL's all-reduce time / "
                          "ours (auto: the default segment size; the ring spreads its segments over NCCL communicators, "
                          "ring_one_lane: all on one, as before session 20; p2p_exchange: one ring step moving a "
                          "whole chunk on one communicator)", "",
                      "| op | segment | in flight | bus GB/s | vs NCCL |", "|---|---|---|---|---|"]
            for r in sweep:
                seg = _size(r["segment_bytes"]) if r["segment_bytes"] else "auto"
                lines.append(f"| {r['op']} | {seg} | {r['in_flight'] or ''} | {r['busbw_gbs']:.2f} | {r['vs_nccl']:.2f}x |")
        ov = part["overlap"]
        lines += ["", f"Overlap: an all-reduce of {_size(ov['bytes'])} beside a matmul loop: efficiency "
                      f"{ov['efficiency']:.2f} (alone {ov['comm_s'] * 1e3:.2f} + {ov['compute_s'] * 1e3:.2f} ms, "
                      f"together {ov['both_s'] * 1e3:.2f} ms).", ""]
    return lines


def _compile(results):
    lines = []
    for w, part in _ok_worlds(results, "compile"):
        lines += [f"## torch.compile under DDP, {w} GPU{'s' if w > 1 else ''} ({part.get('backend')}, "
                  f"{part.get('precision')}; {part.get('rounds')} rounds of {part.get('steps_per_round')} steps)", "",
                  "| model | variant | step ms | tokens/s/GPU | vs our eager DDP | vs torch's eager DDP | warm-up s "
                  "(compile included) | last loss |", "|---|---|---|---|---|---|---|---|"]
        for model, entry in part["models"].items():
            variants = entry["variants"]
            torch_eager = variants.get("torch_ddp")
            for v, fig in variants.items():
                vs_torch = f"{torch_eager['step_s'] / fig['step_s']:.3f}x" if torch_eager else ""
                lines.append(f"| {model} | {v} | {fig['step_s'] * 1e3:.2f} | {fig['tokens_per_s_per_gpu']:,.0f} | "
                             f"{fig.get('speed_vs_ours_ddp', float('nan')):.3f}x | {vs_torch} | {fig['warmup_s']:.1f} | "
                             f"{fig['last_loss']:.4f} |")
            for v, err in entry.get("errors", {}).items():
                lines.append(f"| {model} | {v} | failed: {err} | | | | | |")
        lines.append("")
    return lines


def _training(results):
    worlds = _ok_worlds(results, "training")
    if not worlds:
        return []
    one = dict(worlds).get(1, {}).get("models", {})
    lines = ["## Training (GPT)", "", "| model | GPUs | impl | step ms | tokens/s/GPU | vs torch DDP | scaling vs 1 GPU | "
             "exposed comm | peak GiB | model-state formula GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w, part in worlds:
        for name, entry in part["models"].items():
            ph = entry["phases"]
            torch_ddp = ph.get("torch_ddp", {}).get("tokens_per_s_per_gpu")
            base = (ph.get("solo") or one.get(name, {}).get("phases", {}).get("plain") or {}).get("tokens_per_s_per_gpu")
            for impl, p in ph.items():
                timed = not impl.endswith("nosync") and impl not in ("solo", "plain")
                vs = f"{p['tokens_per_s_per_gpu'] / torch_ddp:.3f}x" if torch_ddp and timed else ""
                scale = f"{100 * p['tokens_per_s_per_gpu'] / base:.1f}%" if base and w > 1 and timed else ""
                exposed = entry.get("exposed_comm_s", {}).get(impl)
                exp = f"{exposed * 1e3:.1f} ms ({100 * exposed / p['step_s']:.1f}%)" if exposed is not None else ""
                formula = p.get("model_state_formula_gib")
                lines.append(f"| {name} | {w} | {impl} | {p['step_s'] * 1e3:.2f} | {p['tokens_per_s_per_gpu']:,.0f} | "
                             f"{vs} | {scale} | {exp} | {p['peak_gib']:.2f} | "
                             f"{'' if formula is None else f'{formula:.1f}'} |")
            if "ours_comm_only" in entry:
                c = entry["ours_comm_only"]
                lines.append(f"| {name} | {w} | ours_comm_only (every bucket, nothing else running) | "
                             f"{c['step_s'] * 1e3:.2f} | | | | | | |")
    return lines + [""]


def _models(results):
    lines = []
    for w, part in _ok_worlds(results, "models"):
        variants = part["variants"]
        lines += [f"## Third-party models, {w} GPUs: median step ms (speed vs torch DDP: median of per-round "
                  "ratios, each round's variants run next to each other)", "",
                  "| model | " + " | ".join(variants) + " | peak GiB torch / ours |", "|---" * (len(variants) + 2) + "|"]
        for name, m in part["models"].items():
            if m.get("status") == "skipped":
                lines.append(f"| {name} | skipped: {m['reason']} |")
                continue
            vs = {v: r["median"] for v, r in m["speed_vs_torch_paired"].items()} if "speed_vs_torch_paired" in m \
                else m.get("speed_vs_torch", {})
            cells = [f"{m['step_ms_median'][v]:.1f}" + (f" ({vs[v]:.3f}x)" if v in vs and v != "torch" else "")
                     for v in variants]
            pk = m["peak_gib_per_variant"]
            lines.append(f"| {name} | " + " | ".join(cells) +
                         f" | {pk.get('torch', 0):.1f} / {pk.get('ours', 0):.1f} |")
        lines.append("")
        lines += _models_memory(w, part)
    return lines


_MEMORY_PARTS = ("constructed", "after_first_step", "resident", "first_steps_peak", "step_transient")


def _models_memory(w, part):
    """Where each variant's memory goes (GiB of `memory_allocated`): after construction, after the first
    step, between steps, the build and warm-up's peak, a steady step's transient; peak = resident + transient."""
    rows = [(name, m) for name, m in part["models"].items() if m.get("memory_gib_per_variant")]
    if not rows:
        return []
    lines = [f"Memory per variant, {w} GPUs (GiB allocated; peak = resident + step transient; "
             "first-steps peak includes the optimizer state's and buckets' first allocation)", "",
             "| model | variant | " + " | ".join(p.replace("_", " ") for p in _MEMORY_PARTS) + " | peak |",
             "|---" * (len(_MEMORY_PARTS) + 3) + "|"]
    for name, m in rows:
        for v, mem in m["memory_gib_per_variant"].items():
            lines.append(f"| {name} | {v} | " + " | ".join(f"{mem.get(p, 0.0):.3f}" for p in _MEMORY_PARTS) +
                         f" | {m['peak_gib_per_variant'].get(v, 0.0):.3f} |")
    return lines + [""]


def _images(results):
    """Images/s per GPU of each variant, ours / torch, the folder against synthetic batches, and the
    scaling efficiency against the world-1 job of the same run (each world size is its own job)."""
    worlds = _ok_worlds(results, "images")
    if not worlds:
        return []
    one = dict(worlds).get(1, {}).get("models", {})
    first = worlds[0][1]
    folder = next((part["folder"] for _, part in worlds if part.get("folder")), None)
    lines = ["## Image classifiers: images/s per GPU, our DDP vs torch DDP, synthetic batches and a JPEG folder", "",
             f"Our ResNet / ViT presets, {first['precision']}; the median of {first['rounds']} interleaved rounds of "
             f"{first['steps']} steps, the slowest rank's. Scaling: images/s per GPU over the same variant's at 1 GPU "
             "in this run."]
    if folder:
        lines[-1] += (f" ours_folder: {folder['jpegs']:,} JPEGs of {folder['side']}x{folder['side']} in "
                      f"{folder['classes']} classes (page cache), {folder['workers_per_rank']} loader workers per rank; "
                      "decode/s: what those workers can decode per rank (the reader's meter).")
    lines[-1] += (" ours_nosync: our DDP with nothing sent (no_sync), each GPU's compute while the others compute "
                  "too; in brackets, over ours at 1 GPU.")
    lines += ["", "| model | GPUs | torch | ours | ours / torch (paired) | ours_nosync | ours_folder | folder / ours | "
              "decode/s per rank | scaling torch / ours / folder | peak GiB torch / ours | grads unlike params (ours) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    num = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"  # noqa: E731
    for w, part in worlds:
        for name, m in part["models"].items():
            ips = m["images_per_s_per_gpu"]
            paired = m.get("vs_torch_paired", {}).get("ours")
            ratio = f"{m['vs_torch']['ours']:.3f}x ({paired['median']:.3f}x)" if paired and "ours" in ips else "-"
            inp = m.get("input", {})
            decode = (f"{inp['decode_capacity_images_per_s_per_rank']:,.0f}"
                      + (" input-bound" if inp.get("input_bound") else "")) if inp else "-"
            base = one.get(name, {}).get("images_per_s_per_gpu", {})
            scaling = " / ".join(f"{100 * ips[v] / base[v]:.0f}%" if v in ips and base.get(v) else "-"
                                 for v in ("torch", "ours", "ours_folder")) if w > 1 else ""
            pk = m["peak_gib"]
            nosync = (f"{ips['ours_nosync']:,.0f} ({100 * ips['ours_nosync'] / base['ours']:.0f}%)"
                      if "ours_nosync" in ips and base.get("ours") else num(ips, "ours_nosync", ",.0f"))
            lines.append(f"| {name} | {w} | {num(ips, 'torch', ',.0f')} | {num(ips, 'ours', ',.0f')} | {ratio} | "
                         f"{nosync} | {num(ips, 'ours_folder', ',.0f')} | {num(inp, 'folder_vs_synthetic', '.2f')} | {decode} | "
                         f"{scaling} | {num(pk, 'torch', '.1f')} / {num(pk, 'ours', '.1f')} | "
                         f"{m.get('grads_unlike_params', {}).get('ours', '-')} |")
    return lines + [""]


def _pipeline_rows(w: int, part: dict) -> list[tuple[str, str, dict, dict]]:
    """(configuration, schedule, ours, torch's) per row, in the order the phase ran them. A run key is
    ``{impl}_{schedule}``, prefixed by its configuration and a space except for the first one
    (``P2xDP2 ours_1f1b``); results from before the phase had layouts have no prefix and no config."""
    runs, rows = part["runs"], {}
    for key, r in runs.items():
        prefix, _, rest = key.rpartition(" ")
        impl, schedule = rest.split("_", 1)
        config = r.get("config") or prefix or f"P{w}"
        rows.setdefault((config, schedule), {})[impl] = r
    out = []
    for (config, schedule), got in rows.items():
        out.append((config, schedule, got.get("ours", {}), got.get("torch", {})))
        if "graphs" in got:  # ours with CUDA graphs (the phase's ``graphs`` variant), against the same torch runs
            out.append((config, f"{schedule}, CUDA graphs", got["graphs"], got.get("torch", {})))
    return out


def _balance(config: dict) -> str:
    halves = "the blocks cut in halves (attention, MLP): layers per stage count half blocks"
    return {"halves": f"compute, {halves}", "halves_time": f"measured time, {halves}"}.get(config["balance"],
                                                                                         config["balance"])


def _stage_layers(r: dict) -> str:
    bounds = r.get("bounds")
    return "/".join(str(b - a) for a, b in zip(bounds, bounds[1:])) if bounds else ""


def _pipeline(results):
    lines = []
    for w, part in _ok_worlds(results, "pipeline"):
        configs = part.get("configs") or {f"P{w}": {"pipeline": w, "data": 1, "balance": "compute"}}
        lines += [f"## Pipeline ({part['model']}, world {w}: {', '.join(configs)}; {part['batch']} x {part['seq']} "
                  f"tokens a step, {part['microbatches']} microbatches a pipeline): ours vs torch.distributed.pipelining",
                  ""]
        if part.get("loss_fn", "lm_loss") != "lm_loss":
            lines += [f"The loss: `{part['loss_fn']}` for every implementation (the compute model counts the head's "
                      "matmul only).", ""]
        for name, c in configs.items():
            if c.get("data", 1) > 1:
                lines.append(f"- {name}: {c['data']} pipelines of {c['pipeline']} stages side by side (ranks by the "
                             f"mesh, pipeline outermost), each on {c['batch_per_pipeline']} sequences in "
                             f"{c['microbatches']} microbatches of {c['microbatch_sequences']}; each stage's gradients "
                             f"averaged over its data group after the schedule; stages balanced by {_balance(c)}.")
            else:
                lines.append(f"- {name}: one pipeline of {c['pipeline']} stages; stages balanced by {_balance(c)}.")
        lines += ["", "| config | schedule | ours ms | ours tokens/s/GPU | torch ms | ours / torch | peak GiB ours / torch "
                  "(max rank) | bubble (formula) | bubble measured / simulated (ours) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        rows = _pipeline_rows(w, part)
        for config, schedule, ours, ref in rows:
            def cell(r, fmt):
                return fmt(r) if r.get("status") == "ok" else f"error: {r.get('reason', '')[:60]}"
            lines.append(f"| {config} | {schedule} | {cell(ours, lambda r: format(r['step_ms'], '.1f'))} | "
                         f"{cell(ours, lambda r: format(r['tokens_per_s_per_gpu'], ',.0f'))} | "
                         f"{cell(ref, lambda r: format(r['step_ms'], '.1f'))} | "
                         f"{format(ours['speed_vs_torch'], '.3f') + 'x' if 'speed_vs_torch' in ours else ''} | "
                         f"{cell(ours, lambda r: format(max(r['peak_gib_per_rank']), '.1f'))} / "
                         f"{cell(ref, lambda r: format(max(r['peak_gib_per_rank']), '.1f'))} | "
                         f"{cell(ours, lambda r: format(r['bubble_formula'], '.3f'))} | "
                         f"{cell(ours, _bubble)} |")
        lines += ["", "Tokens/s per GPU: the global batch's tokens over every rank of the world. Bubble measured: one "
                  "extra step of ours with the engine's timing on (CUDA events around each action's compute; 1 - busy "
                  "/ (P x window), window from stage 0's first forward to the last compute of any rank; with several "
                  "pipelines, the first one's); simulated: the schedule on `simulate` with the measured per-stage costs "
                  "and free communication (measured - simulated: communication and host overhead; simulated - "
                  "formula: uneven stages). Target: measured within 10% of the formula.", ""]
        timed = [(config, schedule, r) for config, schedule, r, _ in rows if r.get("forward_ms_per_rank")]
        if timed:
            lines += ["| config | schedule (ours) | window ms | forward ms per rank | backward ms per rank | layers per "
                      "stage |", "|---|---|---|---|---|---|"]
            for config, schedule, r in timed:
                lines.append(f"| {config} | {schedule} | "
                             f"{' / '.join(format(v, '.1f') for v in r.get('window_ms_per_pipeline', [r['window_ms']]))} | "
                             f"{' / '.join(format(v, '.1f') for v in r['forward_ms_per_rank'])} | "
                             f"{' / '.join(format(v, '.1f') for v in r['backward_ms_per_rank'])} | {_stage_layers(r)} |")
            lines += ["", "Per rank: global ranks 0, 1, ... (with several pipelines the mesh puts pipeline i's stage s "
                      "on rank s x DP + i); a window per pipeline. Layers per stage: embed, the blocks and the head "
                      "cut into stages 0, 1, ... (interleaved: stage c x P + rank is chunk c of that rank).", ""]
        for timed, chain in (("time", "embed, block.0, ..., head"),
                             ("halves_time", "embed, block.0.a, block.0.m, ..., head")):
            costs = part.get("layer_costs", {}).get(timed)
            if costs:
                balance = part.get("time_balance", {})
                # Runs before session 24 recorded one timed balance's sample shape at the top level.
                shape = balance.get(timed, balance).get("sample_shape")
                lines += [f"Balance by {timed}: each layer's forward + backward on one microbatch"
                          f"{f' of {shape[0]} x {shape[1]} tokens' if shape else ''}, measured on the device before "
                          f"the runs (ms, {chain}): {' / '.join(format(c * 1e3, '.2f') for c in costs)}.", ""]
        lines.append("")
    return lines


def _pipeline_big(results):
    """pipeline_trainer's ``--variants big``: a GPT too large for one GPU, each rank building its stage."""
    lines = []
    for w, part in _ok_worlds(results, "pipeline_trainer"):
        if part.get("mode") != "big":
            continue
        m = part["model"]
        lines += [f"## Pipeline trainer, big model ({m['parameters'] / 1e9:.2f}B parameters: {m['n_layer']} layers x "
                  f"{m['n_embd']}, built on the meta device; P={part['pipeline_parallel_size']}, {part['schedule']}, "
                  f"{part['microbatches']} microbatches x {m['seq']} tokens, {part['mixed_precision']})", "",
                  f"{part['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({part['step_s'] * 1e3:.0f} ms a step, setup "
                  f"{part['setup_s']:.1f} s); losses {', '.join(format(x, '.3f') for x in part['losses'])}. DDP would "
                  f"need {part['ddp_estimate_gib']:.0f} GiB a GPU (16 bytes a parameter) against "
                  f"{part['gpu_memory_gib']:.0f} GiB; the whole model in fp32 is {part['whole_model_fp32_gib']:.1f} GiB.",
                  "", "| rank (stage) | parameters | peak device GiB | peak host RSS GiB |", "|---|---|---|---|"]
        for row in part["stages"]:
            lines.append(f"| {row['rank']} | {row['parameters'] / 1e9:.3f}B | {row['peak_allocated_gib']:.1f} | "
                         f"{row['peak_rss_gib']:.1f} |")
        lines.append("")
    return lines


def _tensor(results):
    """The tensor phase: ours vs torch's DTensor TP, one row per configuration (see phases/tensor.py)."""
    lines = []
    for w, part in _ok_worlds(results, "tensor"):
        lines += [f"## Tensor parallelism, {w} GPUs ({part['mixed_precision']}): ours vs torch's parallelize_module "
                  "(same plan, same weights and batches)", "",
                  "| config | model, batch x seq | T x DP | SP | ours ms | ours tokens/s/GPU | ours MFU | torch ms | "
                  "torch tokens/s/GPU | torch MFU | ours / torch | peak GiB ours / torch | max loss diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def cell(r, key, fmt):  # a side that did not run says why once, in its step cell
            if r.get("status") != "ok":
                return f"{r.get('status')}: {r.get('reason', '')[:80]}" if key == "step_s" else ""
            return "-" if r.get(key) is None else format(r[key], fmt)

        for name, row in part["configs"].items():
            ours, ref = row["ours"], row["torch"]
            dp = f" x {row['data_parallel']} {row['strategy']}" if row["data_parallel"] > 1 else ""
            speed = f"{row['speed_vs_torch']:.3f}x" if "speed_vs_torch" in row else ""
            diff = f"{row['max_abs_loss_diff']:.2e}" if "max_abs_loss_diff" in row else ""
            ms = lambda r: cell(r, "step_s", "") if r.get("status") != "ok" else f"{r['step_s'] * 1e3:.1f}"  # noqa: E731
            mfu = lambda r: cell(r, "mfu", ".3f")  # noqa: E731
            lines.append(f"| {name} | {row['model']}, {row['global_batch']} x {row['seq']} | {row['tensor_parallel_size']}"
                         f"{dp} | {'yes' if row['sequence_parallel'] else 'no'} | {ms(ours)} | "
                         f"{cell(ours, 'tokens_per_s_per_gpu', ',.0f')} | {mfu(ours)} | {ms(ref)} | "
                         f"{cell(ref, 'tokens_per_s_per_gpu', ',.0f')} | {mfu(ref)} | {speed} | "
                         f"{cell(ours, 'peak_gib', '.2f')} / {cell(ref, 'peak_gib', '.2f')} | {diff} |")
        for name, row in part["configs"].items():
            alone = row.get("fsdp_alone")
            if alone:
                ran = (f"ran: {alone['step_s'] * 1e3:.0f} ms a step, peak {alone['peak_gib']:.1f} GiB"
                       if alone["status"] == "fits" else alone.get("reason", ""))
                lines += ["", f"{name}: FSDP alone (ours, zero3, no TP) at the same batch: **{alone['status']}** "
                          f"({ran}); estimate {alone['estimate_gib']:.1f} GiB a rank ({alone['model_state_gib']:.1f} "
                          f"model state at 16 bytes a parameter + {alone['activations_gib']:.1f} activations, "
                          f"{alone['sequences_per_rank']} sequence(s) a rank) on a {part['gpu_memory_gib']:.0f} GiB card."]
        for name, row in part["configs"].items():
            after = row.get("ours_bias_after", {})
            if after.get("status") == "ok" and "bias_after_speed_vs_torch" in row:
                lines += ["", f"{name}: ours with the row-parallel bias added after the all-reduce (variant "
                          f"`bias_after`): {after['step_s'] * 1e3:.1f} ms, "
                          f"{row['bias_after_speed_vs_torch']:.3f}x torch (rounds: ours "
                          f"{', '.join(format(x * 1e3, '.1f') for x in row['ours']['step_s_rounds'])} ms; bias after "
                          f"{', '.join(format(x * 1e3, '.1f') for x in after['step_s_rounds'])}; torch "
                          f"{', '.join(format(x * 1e3, '.1f') for x in row['torch']['step_s_rounds'])})."]
        if part.get("big_skipped"):
            lines += ["", f"~7B run skipped: {part['big_skipped']}."]
        flops = part.get("peak_bf16_flops")
        lines += ["", "ours / torch: median over rounds of torch's step / ours (each round's pair back to back); "
                  "MFU: 6 x parameters x tokens/s per GPU / the card's dense bf16 peak "
                  f"({format(flops, '.3g') + ' FLOP/s' if flops else 'none known for this device'}"
                  "); max loss diff: over the first steps, both from the same weights. Target: ours >= 1.00x torch at "
                  "every point.", ""]
    return lines


def _bubble(r) -> str:
    if r.get("bubble_measured") is None:
        return ""
    ratio = r.get("bubble_vs_formula")
    return (f"{r['bubble_measured']:.3f} / {r['bubble_simulated']:.3f}"
            + (f" ({ratio:.2f}x formula)" if ratio is not None else ""))


def _precision(results):
    lines = []
    for w, part in _ok_worlds(results, "precision"):
        lines += [f"## Precision ({part['model']}, micro-batch {part['micro_batch']} x {part['seq']}, our DDP trainer, "
                  f"{w} ranks)", "", "| precision | step ms | tokens/s/GPU | step peak GiB | max loss diff vs fp32 |",
                  "|---|---|---|---|---|"]
        for name, r in part["precisions"].items():
            lines.append(f"| {name} | {r['step_s'] * 1e3:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                         f"{r['step_peak_gib']:.2f} | {r['max_abs_loss_diff_vs_fp32']:.2e} |")
        lines.append("")
    return lines


def _topk(results):
    lines = []
    for _, part in _ok_worlds(results, "topk"):
        methods = part.get("methods", ["exact", "chunked", "sampled"])  # results from before blockmax
        head = "| " + " | ".join(methods) + " |"
        ps = part.get("powersgd", {})
        lines += [f"## Top-K selection ({100 * part['ratio']:g}%): ms per call", "",
                  "| values " + head + (" PowerSGD r4 |" if ps else ""), "|---" * (len(methods) + 1 + bool(ps)) + "|"]
        cell = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        for n, row in part["buckets"].items():
            extra = f" {cell(ps['buckets'].get(n))} |" if ps else ""
            lines.append(f"| {int(n):,} | " + " | ".join(cell(row.get(m)) for m in methods) + " |" + extra)
        by_bucket = part.get("step_ms_by_bucket") or {str(part["bucket_values"]): part["step_ms"]}
        gpu_by_bucket = part.get("step_gpu_ms_by_bucket", {})
        lines += ["", "Per step: the whole gradient in buckets, wall ms (device-only ms where measured: the "
                  "host's launches hidden, as under a busy backward).", "",
                  "| model, bucket values | buckets " + head + (" PowerSGD r4 |" if ps else ""),
                  "|---" * (len(methods) + 2 + bool(ps)) + "|"]
        for bucket, models in by_bucket.items():
            for name, row in models.items():
                gpu = gpu_by_bucket.get(bucket, {}).get(name, {})
                both = lambda w, g: cell(w) + (f" ({g:.2f})" if g is not None else "")  # noqa: E731
                extra = ""
                if ps:
                    extra = " " + both(ps["step_ms_by_bucket"].get(bucket, {}).get(name),
                                       ps.get("step_gpu_ms_by_bucket", {}).get(bucket, {}).get(name)) + " |"
                lines.append(f"| {name}, {int(bucket):,} | {row.get('buckets', '-')} | " +
                             " | ".join(both(row.get(m), gpu.get(m)) for m in methods) + " |" + extra)
        lines.append("")
    return lines


def _profiling(results):
    lines = []
    cats = ["matmul", "attention", "comm", "copy", "optimizer", "other"]
    for w, part in _ok_worlds(results, "profiling"):
        lines += [f"## Profile of a DDP step ({part['model']}, {w} ranks): ms per step of {part['time_kind']}", "",
                  "| impl | wall | " + " | ".join(cats) + " | hook CPU | SM clock MHz | power W |",
                  "|---" * (len(cats) + 5) + "|"]
        for name, r in part["report"].items():
            k = r["ms_by_category"]
            clock = r.get("gpu_clock") or {}
            clock_cells = (f"{clock['sm_clock_mhz']:.0f} | {clock['power_w']:.0f}" if "sm_clock_mhz" in clock else " | ")
            lines.append(f"| {name} | {r['wall_ms_profiled']:.1f} | " + " | ".join(f"{k.get(c, 0.0):.1f}" for c in cats) +
                         f" | {r['python_hook_cpu_ms']:.1f} | {clock_cells} |")
        errors = {r["gpu_clock"]["error"] for r in part["report"].values() if (r.get("gpu_clock") or {}).get("error")}
        if errors:
            lines.append(f"\nGPU clock not sampled: {'; '.join(sorted(errors))}")
        lines.append("")
    return lines


def _monitor(results):
    lines = []
    rows = _ok_worlds(results, "monitor")
    if not rows:
        return lines
    part = rows[0][1]
    lines += [f"## Monitor overhead ({part['model']}, batch {part['batch']} x {part['seq']}, log every "
              f"{part['log_every']})", "", "Per round: (with - without) / without, the slowest rank's step time; "
              "the median over rounds, its 95% bootstrap interval, quartiles.", "",
              "| ranks | without ms | with ms | overhead | 95% CI | quartiles | <= 1% | record_step ms per log step |",
              "|---|---|---|---|---|---|---|---|"]
    for w, part in rows:
        med = part["median_step_s"]
        ci, q = part.get("overhead_pct_median_ci95"), part.get("overhead_pct_quartiles")
        host = part.get("rank0_host_ms", {})
        lines.append(f"| {w} | {med['without'] * 1e3:.2f} | {med['with'] * 1e3:.2f} | "
                     f"{part['monitor_overhead_pct']:+.2f}% | " + (f"{ci[0]:+.2f} / {ci[1]:+.2f}" if ci else "-") +
                     " | " + (f"{q[0]:+.2f} / {q[1]:+.2f}" if q else "-") + f" | {part.get('at_most_1pct', '-')} | "
                     f"{host.get('record_step_per_log_step', float('nan')):.2f} |")
    lines.append("")
    return lines


def _checkpoint(results):
    lines = []
    rows = _ok_worlds(results, "checkpoint")
    if not rows:
        return lines
    part = rows[0][1]
    lines += [f"## Checkpoint cost ({part['model']}, batch {part['batch']} x {part['seq']}, {part['strategy']}, a "
              f"checkpoint every {part['checkpoint_every']} steps)", "",
              "Per round: (mode - none) / none, the slowest rank's step time; the median over rounds and its 95% "
              "bootstrap interval. Async: the snapshot's host time, the write's duration, checkpoints that waited.", "",
              "| ranks | none ms | sync | async | async 95% CI | async < 1% | snapshot ms | write s | waited | "
              "rank 0 file MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w, part in rows:
        ci = part["async_overhead_pct_median_ci95"]
        mb = part.get("rank0_file_mb")
        lines.append(f"| {w} | {part['median_step_s']['none'] * 1e3:.2f} | {part['sync_overhead_pct']:+.2f}% | "
                     f"{part['async_overhead_pct']:+.2f}% | {ci[0]:+.2f} / {ci[1]:+.2f} | {part['async_below_1pct']} | "
                     f"{part['async_snapshot_host_ms']['median_rank_max']:.1f} | {part['async_write_s_median']:.2f}"
                     f"{' (slower than the interval)' if part.get('async_write_slower_than_interval') else ''} | "
                     f"{part['async_checkpoints_that_waited']} | " + (f"{mb:.0f}" if mb is not None else "-") + " |")
    lines.append("")
    return lines


def _memory(results):
    lines = []
    for w, part in _ok_worlds(results, "memory"):
        lines += [f"## Memory ({part['model']}, micro-batch {part['micro_batch']} x {part['seq']}, our DDP trainer, "
                  f"{part['precision']}, {w} ranks)", "",
                  "| activation checkpointing | step ms | tokens/s/GPU | peak GiB | step peak GiB |", "|---|---|---|---|---|"]
        for name, r in part["checkpointing"].items():
            lines.append(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['peak_gib']:.2f} | "
                         f"{r['step_peak_gib']:.2f} |")
        a = part["auto_batch"]
        card = (f" of {part['card_total_gib']:.1f} GiB ({100 * a['train_peak_fraction_of_card']:.0f}%)"
                if a.get("train_peak_fraction_of_card") is not None else "")
        lines += ["", f"`fit(batch_size=\"auto\")`: {a['batch_size']} per rank ({a['reason']}); search "
                  f"{a['search_s']:.1f} s. Then {a['train_steps']} steps at {a['train_step_ms']:.0f} ms "
                  f"({a['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU), peak {a['train_peak_gib']:.2f} GiB{card}; "
                  f"no out-of-memory: {a['no_oom']}; loss finite: {a['loss_finite']}.", ""]
    return lines


def _accuracy(results):
    worlds = _ok_worlds(results, "accuracy")
    if not worlds:
        return []
    first = worlds[0][1]
    target = first["target"]["val_accuracy"]
    lines = [f"## Time to accuracy: the digits image recipe to val_accuracy {target} (dtrain's job)", "",
             "The same global batch at every world size; evaluated every epoch; time to target: from the start of "
             "training to the end of the evaluation that reached it (evaluations included); job: the whole dtrain "
             f"job (model, loaders, workers' start). At most {first['max_epochs']} epochs.", "",
             "| recipe | GPUs | time to target | step | epochs | speed-up vs 1 GPU | job s | last val_accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    one = dict(worlds).get(1, {}).get("recipes", {})
    for w, part in worlds:
        for name, r in part["recipes"].items():
            base = one.get(name, {})
            speed = (f"{base['time_to_target_s'] / r['time_to_target_s']:.2f}x"
                     if r.get("reached") and base.get("reached") and w > 1 else "")
            tt = f"{r['time_to_target_s']:.2f} s" if r.get("reached") else "not reached"
            epochs = f"{r['epochs_to_target']:.0f}" if r.get("reached") else "-"
            acc = f"{r['val_accuracy']:.4f}" if r.get("val_accuracy") is not None else "-"
            lines.append(f"| {name} | {w} | {tt} | {r.get('target_step') or '-'} | {epochs} | {speed} | "
                         f"{r['job_s']:.1f} | {acc} |")
    return lines + [""]


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def _ps(results):
    """The parameter server against our DDP (recommender), and sync / ssp / async on the digits."""
    lines = []
    for w, part in _ok_worlds(results, "ps"):
        rec = part["recommender"]
        tables = " + ".join(f"{r:,} x {d}" for r, d in rec["tables"])
        lines += [f"## Parameter server, world {w}: a recommender ({tables} embedding rows, Zipf "
                  f"{rec['zipf_alpha']}, MLP {rec['hidden']}) vs our DDP with the tables replicated", "",
                  f"Global batch {rec['global_batch']}, {rec['steps']} steps, {rec['optimizer']}; the parameter "
                  f"server's messages on {part['transport']} (CPU-side), models on {part['device']}. Bytes: payload "
                  "per step per worker (PS: rows and MLP pushed + pulled, indices included; DDP: the gradient "
                  f"all-reduced). Time to loss: from the end of the first step until the loss EMA reaches "
                  f"{rec['target_loss']:.4f} ({rec['target_from']}; initial {rec['initial_loss']:.4f}, Bayes "
                  f"{rec['bayes_loss']:.4f}).", "",
                  "| variant | servers x workers | bytes/step/worker | vs DDP | step ms | time to loss | steps | "
                  "server load max/mean | plan max/mean | final loss EMA |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, v in rec["variants"].items():
            ttl = f"{v['time_to_loss_s']:.2f} s" if v["reached"] else "not reached"
            load = f"{v['server_max_over_mean']:.2f}" if "server_max_over_mean" in v else "-"
            plan = f"{v['plan_max_over_mean']:.2f}" if "plan_max_over_mean" in v else "-"
            lines.append(f"| {name} | {v['servers']} x {v['workers']} | {_mib(v['bytes_per_step_per_worker'])} | "
                         f"{v['bytes_vs_ddp']:.3f} | {v['step_ms_median']:.2f} | {ttl} | {v['steps_to_loss'] or '-'} | "
                         f"{load} | {plan} | {v['final_loss_ema']:.4f} |")
        cons = part["consistency"]
        if cons.get("status") != "ok":
            lines += ["", f"Consistency (digits): {cons.get('status')}: {cons.get('reason', '')}", ""]
            continue
        lines += ["", f"Consistency on the digits: {cons['servers']} server, {cons['workers']} workers; "
                  f"{cons['optimizer']}, batch {cons['batch_per_worker']} per worker, {cons['steps_per_worker']} "
                  f"steps each; time to validation accuracy {cons['target_accuracy']} as worker 0 sees it "
                  f"(evaluated every {cons['eval_every']} steps). A slow step sleeps {1e3 * cons['delay_s']:.0f} ms: "
                  f"one slow = worker {cons['slow_worker']} in every step; rotating = worker k mod "
                  f"{cons['workers']} in step k.", "",
                  "| stragglers | mode | time to accuracy | worker 0's step | final accuracy | updates | staleness max | "
                  "mean | pulls delayed | wall s per worker |", "|---|---|---|---|---|---|---|---|---|---|"]
        rows = [("one slow", mode, m) for mode, m in cons["modes"].items()]
        rows += [("rotating", mode, m) for mode, m in cons.get("rotating", {}).items()]
        for pattern, mode, m in rows:
            label = f"{pattern} | " + (f"ssp s={m['staleness_bound']}" if mode == "ssp" else mode)
            tta = f"{m['time_to_accuracy_s']:.2f} s" if m["reached"] else "not reached"
            final = f"{m['final_accuracy']:.3f}" if m["final_accuracy"] is not None else "-"
            walls = ", ".join(f"{x:.2f}" for x in m["wall_s_per_worker"])
            lines.append(f"| {label} | {tta} | {m['steps_to_accuracy'] or '-'} | {final} | {m['updates']} | "
                         f"{m['max_staleness']} | {m['mean_staleness']:.2f} | {m['pulls_delayed']} | {walls} |")
        lines.append("")
    return lines


def _imagenet_projection(results):
    r = results["phases"].get("imagenet_projection", {})
    if r.get("status") != "ok":
        return []
    link, inter = r["link"], r["inter"]
    lines = [f"## Projection (not measured): {r['model']} on ImageNet at 8-256 GPUs under our DDP", "",
             f"The scaling model (`distributed_training.scaling`) calibrated on this run's images phase: "
             f"{r['model']}, {r['batch_per_gpu']} images a GPU at {r['image_size']}x{r['image_size']}, "
             f"{r['precision']}; the link inside a node from {r['link_backend']}'s all-reduce at {link['world']} GPUs "
             f"({link['bandwidth_gbs']:.0f} GB/s bus bandwidth, {link['alpha_s'] * 1e6:.0f} us a message), assumed "
             f"the same in nodes of {r['gpus_per_node']}; between nodes assumed {inter['name']} "
             f"({inter['alpha_s'] * 1e6:.0f} us a message). Compute per step: "
             + "; ".join(f"{label} {s * 1e3:.1f} ms" for label, s in r["compute_s"].items())
             + ". The projection uses the loaded figure. An epoch is 1,281,167 images.", "",
             "Checked on the worlds measured (our DDP's step):", "",
             "| GPUs | compute from | measured ms | predicted ms | error |", "|---|---|---|---|---|"]
    for c in r["checks"]:
        lines.append(f"| {c['world']} | {c['compute']} | {c['measured_s'] * 1e3:.1f} | {c['predicted_s'] * 1e3:.1f} | "
                     f"{100 * c['error']:+.1f}% |")
    measured = ", ".join(f"{w} GPU{'s' if int(w) > 1 else ''} {s / 60:.1f} min" for w, s in r["measured_epoch_s"].items())
    lines += ["", f"Measured epoch time at this batch (synthetic input): {measured}.", "",
              f"Model alone, and anchored at the {r['anchor_world']}-GPU step measured (the model's step at N over its "
              f"step at {r['anchor_world']}, times the measured one):", "",
              "| GPUs (projected) | nodes | step ms | exposed comm ms | images/s | epoch | efficiency vs a loaded GPU "
              "| anchored: step ms | epoch | efficiency vs 1 GPU alone | decode processes a GPU needs |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    span = lambda s: f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"  # noqa: E731
    for row in r["rows"]:
        need = f"{row['decode_processes_per_gpu']:.1f}" if row["decode_processes_per_gpu"] else "-"
        anchored = (f"{row['anchored_step_s'] * 1e3:.1f} | {span(row['anchored_epoch_s'])} | "
                    f"{100 * row['anchored_efficiency_vs_one_gpu']:.0f}%") if "anchored_step_s" in row else "- | - | -"
        lines.append(f"| {row['gpus']} | {row['nodes']} | {row['step_s'] * 1e3:.1f} | {row['exposed_s'] * 1e3:.1f} | "
                     f"{row['images_per_s']:,.0f} | {span(row['epoch_s'])} | {100 * row['efficiency_vs_loaded_gpu']:.0f}% "
                     f"| {anchored} | {need} |")
    if r.get("decoded_images_per_s_per_process"):
        lines += ["", f"Decode processes: images/s a GPU must be fed over what one loader process decoded here "
                      f"({r['decoded_images_per_s_per_process']:,.0f} images/s, JPEGs smaller than ImageNet's: a lower "
                      "bound on ImageNet's need)."]
    return lines + [""]


def _model_check(results):
    mc = results["phases"].get("model_check")
    if not mc or mc.get("status") != "ok":
        return []
    lines = []
    this = mc["this_run"]
    if this.get("status") == "ok":
        lk = this["link"]
        lines += ["## Scaling model: calibrated on this run, error on the measured points", "",
                  f"Link from the {lk['world']}-rank {'gloo' if results.get('smoke') else 'NCCL'} all-reduce: alpha {lk['alpha_s'] * 1e6:.1f} us, bandwidth "
                  f"{lk['bandwidth_gbs']:.1f} GB/s; overlap {next(iter(this['models'].values()))['overlap']:.2f} "
                  "(all-reduce beside a matmul loop). Compute, optimizer and each strategy's own overhead from the "
                  "1-GPU runs.", "", "| model | GPUs | impl | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
        for c in this["checks"]:
            lines.append(f"| {c['model']} | {c['world']} | {c['strategy']} | {c['measured_s'] * 1e3:.2f} | "
                         f"{c['predicted_s'] * 1e3:.2f} | {100 * c['error']:+.1f}% |")
        if this.get("largest_error") is not None:
            lines += ["", f"Largest error: {100 * this['largest_error']:.1f}%."]
        if this.get("break_even"):
            lines += ["", "Where compression pays (model): the link bandwidth per rank below which each compressed "
                      "DDP's step is shorter than dense DDP's, against this machine's calibrated link and the "
                      "speed-up measured here.", "",
                      "| model | GPUs | impl | pays below (GB/s) | this link (GB/s) | measured vs dense |",
                      "|---|---|---|---|---|---|"]
            for b in this["break_even"]:
                be = b["break_even_gbs"]
                shown = "never" if be is None else "any speed" if be == float("inf") else f"{be:.1f}"
                speed = "" if b["measured_speedup"] is None else f"{b['measured_speedup']:.3f}x"
                lines.append(f"| {b['model']} | {b['world']} | {b['strategy']} | {shown} | {b['link_gbs']:.1f} | "
                             f"{speed} |")
        proj = this["projections"]
        lines += ["", "## Projections (model output, not measurements)", "",
                  f"Inside a node: the calibrated link; between nodes: {proj['inter']['name']} "
                  f"({proj['inter']['bandwidth_gbs']:.0f} GB/s, {proj['inter']['alpha_s'] * 1e6:.0f} us); "
                  f"{proj['gpus_per_node']} GPUs a node.", "", "| model | GPUs | choice | efficiency | why |",
                  "|---|---|---|---|---|"]
        for name, rows in proj["models"].items():
            for r in rows:
                eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
                if r["efficiency"] is not None and r["efficiency"] > 1.0:
                    eff += " (over 100%: the calibration does not fit this run)"
                lines.append(f"| {name} | {r['gpus']} | {r['choice']} | {eff} | {r['reason']} |")
        lines.append("")
    else:
        lines += [f"## Scaling model on this run: {this.get('status')} ({this.get('reason')})", ""]
    for source, data in mc["ddp_runs"].items():
        if not data["rows"]:
            continue
        lines += [f"## Scaling model on DDP runs ({source}): measured vs both overlap bounds", "",
                  "| model | micro-batch | GPUs | measured ms | model, overlap 1 | model, overlap 0 | implied overlap |",
                  "|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            lines.append(f"| {r['model']} | {r['micro_batch']} | {r['world']} | {r['measured_s'] * 1e3:.1f} | "
                         f"{r['predicted_overlap1_s'] * 1e3:.1f} ({100 * r['error_overlap1']:+.1f}%) | "
                         f"{r['predicted_overlap0_s'] * 1e3:.1f} ({100 * r['error_overlap0']:+.1f}%) | "
                         f"{'n/a' if r.get('implied_overlap') is None else format(r['implied_overlap'], '.2f')} |")
        lines.append("")
    return lines


def _slug(source: str) -> str:
    return "this_run" if source == "this run" else re.sub(r"[^A-Za-z0-9_.-]", "_", Path(source).stem)


def plots(results: dict, folder: Path) -> list[str]:
    """Every plot the results allow; returns the file names written. ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    card, written = results["card"], []

    def save(fig, ax, name, **kw):
        save_figure(fig, ax, folder / name, **kw)
        written.append(name)

    for w, part in _ok_worlds(results, "collectives"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for op in dict.fromkeys(r["op"] for r in part["rows"]):
            rows = [r for r in part["rows"] if r["op"] == op]
            ax.plot([r["bytes"] for r in rows], [r["busbw_gbs"] for r in rows], marker="o", label=op)
        save(fig, ax, f"collectives_world{w}.png", xlabel="message bytes", ylabel="bus bandwidth (GB/s)",
             title=f"Collectives, {w} ranks, {card}", log2x=True)
    for w, part in _ok_worlds(results, "ps"):  # loss against wall time: what time-to-loss reads off
        rec = part["recommender"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, v in rec["variants"].items():
            if "elapsed" in v:
                ax.plot(v["elapsed"], v["loss_ema"], label=name)
        ax.axhline(rec["target_loss"], color="gray", linestyle="--", linewidth=0.8, label="target")
        ax.set_xscale("log")
        save(fig, ax, f"ps_loss_world{w}.png", xlabel="seconds since the first step (log)", ylabel="training loss EMA",
             title=f"Parameter server vs DDP, world {w}, {card}")
    mc = results["phases"].get("model_check", {})
    this = mc.get("this_run", {}) if mc.get("status") == "ok" else {}
    for name, rows in this.get("projections", {}).get("models", {}).items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        base = rows[0]["step_s"]["ddp"]
        for strategy in rows[0]["step_s"]:
            ax.plot([r["gpus"] for r in rows], [100 * base / r["step_s"][strategy] for r in rows], marker=".",
                    label=strategy)
        save(fig, ax, f"projection_{name}.png", xlabel="GPUs", ylabel="projected scaling efficiency (%)",
             title=f"{name}: projection, not measurement ({card} compute)", log2x=True)
    checks = this.get("checks", [])
    if checks:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = range(len(checks))
        ax.bar([x - 0.2 for x in xs], [c["measured_s"] * 1e3 for c in checks], width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [c["predicted_s"] * 1e3 for c in checks], width=0.4, label="model")
        ax.set_xticks(list(xs), [f"{c['model']}\n{c['world']}x {c['strategy']}" for c in checks], rotation=60,
                      fontsize=6)
        save(fig, ax, "model_vs_measured.png", xlabel="", ylabel="step ms", title=f"Scaling model vs measurement, {card}")
    for source, data in mc.get("ddp_runs", {}).items() if mc.get("status") == "ok" else ():
        rows, projection = data["rows"], data["projection"]
        if not rows:
            continue
        src_card = rows[0]["card"]
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = list(range(len(rows)))
        ax.bar([x - 0.27 for x in xs], [r["measured_s"] * 1e3 for r in rows], width=0.27, label="measured")
        ax.bar(xs, [r["predicted_overlap1_s"] * 1e3 for r in rows], width=0.27, label="model, overlap 1")
        ax.bar([x + 0.27 for x in xs], [r["predicted_overlap0_s"] * 1e3 for r in rows], width=0.27,
               label="model, overlap 0")
        ax.set_xticks(xs, [f"{r['model']}\nmicro-batch {r['micro_batch']}" for r in rows], fontsize=8)
        save(fig, ax, f"ddp_check_{_slug(source)}.png", xlabel="", ylabel="step time (ms)",
             title=f"Scaling model vs measured DDP steps, {rows[0]['world']}x {src_card}")
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in dict.fromkeys((e["model"], e["micro_batch"]) for e in projection):
            pts = [e for e in projection if (e["model"], e["micro_batch"]) == key]
            line, = ax.plot([e["gpus"] for e in pts], [100 * e["efficiency_overlap1"] for e in pts], marker="o",
                            label=f"{key[0]} mb {key[1]}, overlap 1")
            ax.plot([e["gpus"] for e in pts], [100 * e["efficiency_overlap0"] for e in pts], marker="x",
                    linestyle="--", color=line.get_color(), label=f"{key[0]} mb {key[1]}, overlap 0")
        save(fig, ax, f"ddp_projection_{_slug(source)}.png", xlabel="GPUs (8 a node, 400 Gb/s InfiniBand between nodes)",
             ylabel="DDP weak-scaling efficiency (%)", title=f"PROJECTION (model output), calibrated on {src_card}",
             log2x=True)
    return written
