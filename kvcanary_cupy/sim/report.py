"""What a ``kvcanary sim`` run shows: the table on stdout and the PNG plot."""

from __future__ import annotations

import json
import os
import tempfile

PLOT_HINT = "install matplotlib for the plot: pip install 'kvcanary-cupy[plot]'"


def _fmt(value, spec="", none="-"):
    return none if value is None else format(value, spec)


def format_table(result, *, step_name: str = "simulated step") -> str:
    doc = result.to_json()
    lines = [f"{'fault class':<30} {'by design':<10} {'injected':>8} {'detected':>8} {'rate':>7} "
             f"{'latency med/max':>15} {'leaked':>6}  first reason"]
    for f in doc["faults"]:
        rate = _fmt(f["detection_rate"] and 100 * f["detection_rate"], ".1f")
        rate = rate + "%" if f["detection_rate"] is not None else rate
        latency = f"{_fmt(f['latency_steps_median'], 'g')} / {_fmt(f['latency_steps_max'])}"
        lines.append(f"{f['name']:<30} {'visible' if f['detectable'] else 'blind':<10} {f['injected']:>8} "
                     f"{f['detected']:>8} {rate:>7} {latency:>15} {f['contained']['leaked_requests']:>6}  "
                     f"{_fmt(f['first_reason'])}")
    blind = [f for f in doc["faults"] if not f["detectable"]]
    for f in blind:
        lines.append(f"  blind by design, {f['name']}: {f['why_not_detectable']}")
    contained = [f["contained"] for f in doc["faults"]]
    lines.append(f"containment from the reports alone: {sum(c['requests_aborted'] for c in contained)} requests aborted, "
                 f"{sum(c['cached_blocks_evicted'] for c in contained)} cached blocks evicted; leaked (requests that read "
                 f"poisoned KV after a detection): {sum(c['leaked_requests'] for c in contained)}")
    clean, cost = doc["clean"], doc["cost"]
    lines.append(f"clean run: {clean['steps']} steps, {clean['false_positives']} false positives; "
                 f"violations outside any fault's blast radius in the faulty run: {result.faulty.unattributed}")
    lines += getattr(result, "notes", [])  # what a job adds under its clean run (kvcanary hf: the lost-store check)
    device = (f"; device: canary {cost['canary_device_us']} us, model KV store {cost['model_kv_store_device_us']} us"
              if cost["canary_device_us"] is not None else "")
    fraction = _fmt(cost["canary_host_fraction"] and 100 * cost["canary_host_fraction"], ".0f")
    lines.append(f"canary cost per step (median, {cost['measured_on']}): host {_fmt(cost['canary_host_us'])} us of a "
                 f"{_fmt(cost['engine_step_host_us'])} us {step_name} ({fraction}%){device}")
    if cost.get("canary_ops_per_step") is not None:
        lines.append(_targets_line(cost))
    if result.partial:
        lines.append(f"PARTIAL: interrupted after {result.faulty.steps} of {result.config.steps} faulty steps and "
                     f"{result.clean.steps} clean ones; the counts above cover only those")
    return "\n".join(lines)


def _targets_line(cost: dict) -> str:
    """The canary's ops per step and, under CUDA, its kernel time and the two 2x targets as ratios."""
    line = f"canary ops per step (median): {_fmt(cost['canary_ops_per_step'], 'g')}"
    if cost.get("canary_bound_host_us") is not None:
        line += (f"; host {_fmt(cost['canary_host_x_bound'])}x those ops at the bound path's per-op host figures "
                 f"({cost['canary_bound_host_us']} us; target <= 2)")
    if cost.get("canary_device_us") is not None:
        line += (f"; kernels {_fmt(cost['canary_kernel_us'])} us back to back ({cost['kernel_samples']} samples, "
                 f"{cost['kernel_samples_spoiled']} spoiled), events {_fmt(cost['canary_event_x_kernel'])}x kernels "
                 "(target <= 2)")
    return line


def check_writable(path: str) -> str | None:
    """None when ``path`` can be written (atomically, through a temporary file beside it); otherwise
    one line saying why not."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        return f"{target} is a directory"
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvcanary-check-"):
            pass
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror or exc}"
    return None


def _write_atomically(path: str, write) -> str:
    """``write(file)`` into a temporary file beside ``path``, then rename it over ``path``: a reader
    sees the old file or the whole new one, never half of it.  Returns the absolute path."""
    target = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix="." + os.path.basename(target) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a plain open() would honour the umask
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def write_json(result, path: str) -> str:
    """Write the JSON report atomically; returns its absolute path."""
    text = json.dumps(result.to_json(), indent=2) + "\n"
    return _write_atomically(path, lambda f: f.write(text.encode()))


def write_plot(result, path: str, *, name: str = "kvcanary sim") -> str | None:
    """Write the PNG atomically: per fault class, the share of injected faults the canary reported and
    how many steps after the fault it did.  Returns None, or the one line to print when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"kvcanary: plot skipped: {PLOT_HINT}"
    faults = result.to_json()["faults"][::-1]  # top to bottom in the table's order
    rows = range(len(faults))
    seen, blind = "tab:blue", "0.75"
    fig, (ax_rate, ax_lat) = plt.subplots(1, 2, figsize=(12.5, 0.42 * len(faults) + 2.2), sharey=True,
                                          gridspec_kw={"width_ratios": [3, 2]})
    for y, f in zip(rows, faults):
        rate = 100 * (f["detection_rate"] or 0)
        ax_rate.barh(y, rate, color=seen if f["detectable"] else blind)
        label = f"{f['detected']} of {f['injected']} reported" + ("" if f["detectable"] else ": blind by design")
        ax_rate.text(2, y, label, va="center", fontsize=8, color="white" if rate >= 30 else "0.3")
        if f["latency_steps_max"] is None:
            ax_lat.text(0.2, y, "never reported" if f["injected"] else "not injected", va="center", fontsize=8,
                        color="0.4")
            continue
        ax_lat.plot([0, f["latency_steps_max"]], [y, y], color=seen, linewidth=2, solid_capstyle="butt")
        ax_lat.plot([f["latency_steps_max"]], [y], color=seen, marker="|", markersize=12, markeredgewidth=2)
        ax_lat.plot([f["latency_steps_median"]], [y], color="black", marker="o", markersize=6, linestyle="none")
    ax_rate.set_yticks(list(rows), [f["name"] for f in faults])
    for tick, f in zip(ax_rate.get_yticklabels(), faults):
        if not f["detectable"]:
            tick.set_color("0.45")
    ax_rate.set_xlim(0, 100)
    ax_rate.set_xlabel("faults injected that the canary reported (%)\n"
                       "grey: a class the canary cannot see by design (the table says why)")
    top = max([f["latency_steps_max"] or 0 for f in faults] + [4])
    ax_lat.set_xlim(-0.5, top + 0.5)
    ax_lat.xaxis.get_major_locator().set_params(integer=True)
    ax_lat.set_xlabel("steps from the fault to its first report (0: the same step)")
    ax_lat.legend(handles=[plt.Line2D([], [], color="black", marker="o", linestyle="none", label="median"),
                           plt.Line2D([], [], color=seen, marker="|", markersize=12, markeredgewidth=2, linewidth=2,
                                      label="0 to max")],
                  loc="best", fontsize=8, framealpha=1)
    for ax in (ax_rate, ax_lat):
        ax.grid(axis="x", color="0.9")
        ax.set_axisbelow(True)
    cfg = result.config
    title = (f"{name}: {result.faulty.steps:,} steps with faults injected one at a time, then "
             f"{result.clean.steps:,} clean steps: {result.clean.violations} false positives")
    if result.partial:
        title = "PARTIAL (interrupted) " + title
    fig.suptitle(title + f"\nseed {cfg.seed}, {cfg.addressing} tables, {cfg.device}", fontsize=10)
    fig.tight_layout()
    _write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return None
