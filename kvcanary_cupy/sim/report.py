"""What a ``kvcanary sim`` run shows: the table on stdout and the PNG plot."""

from __future__ import annotations

import json

PLOT_HINT = "install matplotlib for the plot: pip install 'kvcanary-cupy[plot]'"


def _fmt(value, spec="", none="-"):
    return none if value is None else format(value, spec)


def format_table(result) -> str:
    doc = result.to_json()
    lines = [f"{'fault class':<30} {'by design':<10} {'injected':>8} {'detected':>8} {'rate':>7} "
             f"{'latency med/max':>15}  first reason"]
    for f in doc["faults"]:
        rate = _fmt(f["detection_rate"] and 100 * f["detection_rate"], ".1f")
        rate = rate + "%" if f["detection_rate"] is not None else rate
        latency = f"{_fmt(f['latency_steps_median'], 'g')} / {_fmt(f['latency_steps_max'])}"
        lines.append(f"{f['name']:<30} {'visible' if f['detectable'] else 'blind':<10} {f['injected']:>8} "
                     f"{f['detected']:>8} {rate:>7} {latency:>15}  {_fmt(f['first_reason'])}")
    blind = [f for f in doc["faults"] if not f["detectable"]]
    for f in blind:
        lines.append(f"  blind by design, {f['name']}: {f['why_not_detectable']}")
    clean, cost = doc["clean"], doc["cost"]
    lines.append(f"clean run: {clean['steps']} steps, {clean['false_positives']} false positives; "
                 f"violations outside any fault's blast radius in the faulty run: {result.faulty.unattributed}")
    device = (f"; device: canary {cost['canary_device_us']} us, model KV store {cost['model_kv_store_device_us']} us"
              if cost["canary_device_us"] is not None else "")
    fraction = _fmt(cost["canary_host_fraction"] and 100 * cost["canary_host_fraction"], ".0f")
    lines.append(f"canary cost per step (median, {cost['measured_on']}): host {cost['canary_host_us']} us of a "
                 f"{cost['engine_step_host_us']} us simulated step ({fraction}%){device}")
    return "\n".join(lines)


def write_json(result, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=2)
        f.write("\n")


def write_plot(result, path: str) -> str | None:
    """Write the PNG; returns None, or the one line to print when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"kvcanary: plot skipped: {PLOT_HINT}"
    faults = result.to_json()["faults"]
    names = [f["name"] for f in faults][::-1]
    rates = [100 * (f["detection_rate"] or 0) for f in faults][::-1]
    medians = [f["latency_steps_median"] or 0 for f in faults][::-1]
    maxima = [f["latency_steps_max"] or 0 for f in faults][::-1]
    colors = ["tab:blue" if f["detectable"] else "tab:gray" for f in faults][::-1]
    fig, (ax_rate, ax_lat) = plt.subplots(1, 2, figsize=(12, 0.42 * len(names) + 1.6), sharey=True)
    ax_rate.barh(names, rates, color=colors)
    for name, f in zip(names, faults[::-1]):
        label = f"{f['detected']}/{f['injected']}" + ("" if f["detectable"] else "  blind by design")
        ax_rate.text(2, name, label, va="center", fontsize=8, color="white" if f["detection_rate"] else "black")
    ax_rate.axvline(95, color="tab:red", linestyle="--", linewidth=1, label="95% target")
    ax_rate.set_xlim(0, 100)
    ax_rate.set_xlabel("detection rate (%)")
    ax_rate.legend(loc="lower right", fontsize=8)
    ax_lat.barh(names, medians, color=colors, label="median")
    ax_lat.scatter(maxima, names, color="black", marker="|", s=120, label="max", zorder=3)
    ax_lat.set_xlabel("detection latency (steps)")
    ax_lat.legend(loc="lower right", fontsize=8)
    cfg = result.config
    fig.suptitle(f"kvcanary sim: {cfg.steps} steps, seed {cfg.seed}, {cfg.addressing} tables, {cfg.device} "
                 f"(grey: blind by design); clean run: {result.clean.violations} false positives", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
