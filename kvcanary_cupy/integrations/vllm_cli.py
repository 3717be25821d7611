"""The ``kvcanary vllm`` command line (the run itself is :mod:`.vllm_run`, imported once vLLM is)."""

from __future__ import annotations

import os
import sys


def add_arguments(p) -> None:
    seed, episodes, model, dtype, mode = 0, 1, "tiny", "float32", "PARTIAL"  # VllmRunConfig's defaults
    p.add_argument("--seed", type=int, default=seed, help="same seed, same prompts and fault choices (>= 0)")
    p.add_argument("--faults", default="all", metavar="A,B,...", help="fault classes to inject, or all (see --list-faults)")
    p.add_argument("--episodes", type=int, default=episodes, help="injections per fault class")
    p.add_argument("--model", choices=("tiny", "8x512"), default=model, help="the random-weight Llama served")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=dtype, help="the model's and KV's dtype")
    p.add_argument("--real-kv-hash-mode", choices=("PARTIAL", "ALL"), default=mode,
                   help="fingerprint 16 bytes of each slot, or all of them")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: vLLM's CPU build")
    p.add_argument("--json", default="kvcanary-vllm.json", metavar="PATH", help="report file ('' for none)")
    p.add_argument("--plot", default="kvcanary-vllm.png", metavar="PATH", help="PNG plot ('' for none; needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--list-faults", action="store_true", help="print the fault classes and exit")


def main(args) -> int:
    """``kvcanary vllm``: returns the exit status."""
    from ..sim.report import check_writable, format_table, write_json, write_plot

    try:
        from .vllm import import_vllm

        import_vllm()
    except ImportError as exc:
        print(f"kvcanary vllm: {exc}", file=sys.stderr)
        return 2
    from .vllm_faults import FAULTS
    from .vllm_run import VllmRunConfig, run

    if args.list_faults:
        for name, cls in FAULTS.items():
            print(f"{name}: {cls.description} (bug class: {cls.bug_class})")
        return 0
    names = tuple(FAULTS) if args.faults.strip() == "all" else tuple(n.strip() for n in args.faults.split(",") if n.strip())
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        print(f"kvcanary vllm: unknown fault class {', '.join(unknown) or '(none given)'}; choose from: {', '.join(FAULTS)}",
              file=sys.stderr)
        return 2
    if args.seed < 0 or args.episodes < 1:
        print("kvcanary vllm: --seed must be >= 0 and --episodes >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda":
        print("kvcanary vllm: --device cuda needs a CUDA build of vLLM; this run uses vLLM's CPU engine (--device cpu)",
              file=sys.stderr)
        return 2
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = check_writable(path) if path else None
        if problem:
            print(f"kvcanary vllm: {flag} {path}: {problem}", file=sys.stderr)
            return 2
    config = VllmRunConfig(seed=args.seed, faults=names, episodes=args.episodes, model=args.model, dtype=args.dtype,
                           real_kv_hash_mode=args.real_kv_hash_mode)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or args.quiet:
        result = run(config)
    else:
        with tqdm(total=len(names) * args.episodes + 1, desc="kvcanary vllm (faults, then clean)", unit="episode",
                  leave=False) as bar:
            result = run(config, progress=bar.update)
    if not args.quiet:
        print(format_table(result))
        print(f"clean run: greedy outputs {'identical to' if result.outputs_unchanged else 'DIFFERENT from'} a run without the canary")
    written = [write_json(result, args.json)] if args.json else []
    note = write_plot(result, args.plot) if args.plot else None
    if args.plot and not note:
        written.append(os.path.abspath(args.plot))
    if written and not args.quiet:
        print("wrote " + ", ".join(written))
    if note:
        print(note)
    return 130 if result.partial else 0
