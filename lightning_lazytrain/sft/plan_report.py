"""The text ``lazytrain plan`` prints, from the answer it would print as JSON with ``--json``."""

from __future__ import annotations

from lightning_lazytrain.schedule.batch_search import MAX_BATCH
from lightning_lazytrain.units import GIB

_TIER_NAMES = {"host": "host RAM", "disk": "spill disk", "checkpoint": "ckpt disk"}
_LETTER = {"gpu": "G", "cpu": "C", "nvme": "N", "recompute": "r"}


def _tiers(asked: dict, device: str) -> list[str]:
    lines = [f"  {'':<10} {'piece':<42} {'GiB':>9}"]
    for key, tier in asked["tiers"].items():
        if not tier["need_bytes"] and not tier["have_bytes"]:
            continue  # no spill dir: nothing goes to that disk
        name = device if key == "gpu" else _TIER_NAMES.get(key, key)
        for piece, b in tier["pieces"].items():
            lines.append(f"  {name:<10} {piece:<42} {b / GIB:>9.2f}")
        short = tier["need_bytes"] - tier["have_bytes"]
        verdict = f"SHORT by {short / GIB:.2f} GiB" if short > 0 else "ok"
        need, have = tier["need_bytes"] / GIB, tier["have_bytes"] / GIB
        lines.append(f"  {name:<10} {'need / have':<42} {need:>9.2f} / {have:.2f}  {verdict}")
    return lines


def _plan_lines(f: dict, seq: int, world: int, peak_tflops: float, device: str, frozen: bool = False) -> list[str]:
    s = f["schedule"]
    if s is None:
        return ["  no plan fits (see the notes)"]
    homes = s["homes"]
    counts = ", ".join(f"{t} {homes.count(t)}" for t in ("gpu", "cpu", "nvme", "recompute"))
    solve = s["info"].get("solve_seconds")
    how = f"{s['status']}" + (f" in {solve:.2f} s, gap {s['info'].get('mip_gap', 0):.4f}" if solve is not None else "")
    p = f["prediction"]
    tokens = f["batch"] * seq * world / p["step_s"]
    mfu = f", MFU {f['model_tflops'] / peak_tflops:.2f} of the bf16 peak" if peak_tflops else ""
    slices = s.get("micro_batches", 1)
    sliced = f"; each layer in {slices} row slices ({-(-f['batch'] // slices)} rows at most)" if slices > 1 else ""
    return [
        f"  plan ({how}): boundaries {counts}; graphs kept {sum(s['keep_graph'])}{sliced}",
        "  homes (G gpu, C cpu, N nvme, r recompute): " + "".join(_LETTER[t] for t in homes),
        f"  predicted step {p['step_s']:.3g} s = forward {p['forward_s']:.3g} + backward {p['backward_s']:.3g} + "
        f"head {p['head_s']:.3g} + exposed {p['exposed_s']:.3g} + update {p['update_s']:.3g}; "
        f"{f['model_tflops']:.1f} model-TFLOPS per {device}{mfu}, {tokens:,.0f} tokens/s"
        + ("; model FLOPs 4 per frozen and 6 per trained parameter a token" if frozen else ""),
    ]


def _mode_lines(modes: list[dict]) -> list[str]:
    """The checkpoint modes (`schedule/checkpoint_modes.py`) and whether each fits the checkpoint disk."""
    return [f"  checkpoint mode {m['name']}: {m['need_bytes'] / GIB:.2f} GiB ({m['bytes_each'] / GIB:.2f} GiB each)"
            f" {'fits' if m['fits'] else 'does not fit'}; {m['how']}" for m in modes]


def _frozen_words(m: dict) -> str:
    """A LoRA plan's frozen base beside the trainable count, with its storage."""
    if not m.get("frozen_params"):
        return ""
    kind = "bf16" if m.get("quantize", "none") == "none" else m["quantize"]
    return f"trained over a frozen {m['frozen_params'] / 1e9:.2f} B {kind} base "


def render(answer: dict) -> str:
    m, g, r, asked = answer["model"], answer["gpu"], answer["run"], answer["asked"]
    device = "CPU" if g["name"] == "cpu" else "GPU"  # plan_machine.cpu_machine: a run on the CPU
    out = [
        f"lazytrain plan: {m['architecture']}, {m['layers']} layers, {m['params'] / 1e9:.2f} B parameters "
        f"{_frozen_words(m)}(config: {m['config']})",
        f"{device}: {g['description']}, {g['memory_bytes'] / GIB:.1f} GiB ({g['source']})",
        f"times: {asked['scaling']}",
        f"host: {answer['host']['available_bytes'] / GIB:.1f} GiB RAM available ({answer['host']['source']}); "
        f"CPU update "
        f"{answer['host']['update_params_per_s'] / 1e9:.2f} G params/s ({answer['host']['update_source']})",
        f"run: batch {asked['batch']} x seq {r['seq']}, {r['precision']}, {r['world_size']} process(es), "
        f"schedule {r['schedule']}, optimizer states {r['optimizer_state_bytes_per_param']:.2f} B/param, "
        f"layer kernels: {r['kernels']}",
        f"batch {asked['batch']}: {'fits' if asked['fits'] else 'DOES NOT FIT'}",
    ]
    out += (
        _tiers(asked, device)
        + _plan_lines(asked, r["seq"], r["world_size"], g["bf16_tflops"], device, bool(m.get("frozen_params")))
        + [f"  gradients wait for the norm on: {asked.get('gradient_home', 'host')} (gradient_home)"]
        + _mode_lines(asked.get("checkpoint_modes") or [])
        + ([f"  {asked['checkpoint_verdict']}"] if asked.get("checkpoint_verdict") else [])
        + [f"  note: {n}" for n in asked["notes"]]
    )
    best = answer.get("largest")
    if best is None and answer["largest_searched"]:
        out.append(f"largest batch the {device} takes: none (not even batch 1)")
    elif best is not None and not best["fits_gpu"]:
        out.append(f"largest batch the {device} takes: none found at or below {best['batch']}")
    elif best is not None:
        line = f"largest batch the {device} takes: {best['batch']}"
        slices = (best["schedule"] or {}).get("micro_batches", 1)
        if slices > 1:  # the predicted time is the whole batch's: slices this small may run slower
            line += f" in {slices} layer row slices"
        if best["prediction"] is not None:
            line += f" (predicted {best['prediction']['step_s']:.3g} s/step, {best['model_tflops']:.1f} model-TFLOPS)"
        out.append(line + (" (where the search stops)" if best["batch"] >= MAX_BATCH else ""))
        out += [f"  note: {n}" for n in best["notes"]]
    return "\n".join(out)
