"""A prefill -> decode transfer between two processes for tests/test_distributed_transfer.py.

:func:`run_transfers` spawns two ranks (``torch.multiprocessing``) joined in one process group on
127.0.0.1: rank 0 is the prefill side, rank 1 the decode side.  For each case both build the same
random model and pools from its seed (tests/test_digest_transfer.py's :func:`setup`: a vLLM-NHD
sender pool, a FlashInfer-HND receiver pool of another page size, unrelated page ids and a previous
owner's bytes); rank 0 digests what it sends (:func:`send`) and sends each request's KV, staged
``[L, 2, n, H, strip]``, and its 64-byte :class:`kc.DigestRecord` over ``torch.distributed``
(``send``/``recv``; a record that is not sent travels as its flag), rank 1 receives them, lands
them in its own pool with the case's fault (:func:`receive`: the pool's bytes are host arrays,
placed on the rank's device for the digest), digests its own memory and writes its verdicts to
``<out>/rank1.json``.  ``array``: "numpy" or "torch_cpu" over gloo (the KV on the
host), "torch_cuda" over NCCL (rank r on cuda:r: the KV crosses between the GPUs).  A run that
does not finish within its timeout is killed and reported as hung.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import numpy as np

from dist_harness import free_port, spawn

GPU_ARRAYS = ("torch_cuda",)


def run_transfers(array: str, out_dir: str, cases: list, *, timeout: float = 240.0) -> list:
    """The receiver's verdict names for each of ``cases`` ((fault, spec name, seed, lengths)), in order.

    Raises TimeoutError when a rank is still running at ``timeout`` (both are killed first) and
    RuntimeError with the rank's traceback when one failed."""
    spawn(_entry, (array, free_port(), out_dir, [tuple(c) for c in cases]), 2, timeout, f"the {array} transfer ranks")
    results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    for r, result in enumerate(results):
        if "crashed" in result:
            raise RuntimeError(f"rank {r} crashed:\n{result['crashed']}")
    return results[1]["verdicts"]


def _entry(rank: int, array: str, port: int, out_dir: str, cases: list) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gpu = array in GPU_ARRAYS
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    result = {}
    try:
        result["verdicts"] = [_case(rank, array, *case) for case in cases]
    except Exception:  # recorded: the test names the rank
        result = {"crashed": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _case(rank: int, array: str, fault: str, spec_name: str, seed: int, lengths) -> list | None:
    import torch
    import torch.distributed as dist

    import test_digest_transfer as t
    from conftest import get_backend_or_skip

    ab = get_backend_or_skip(array)
    spec = {"full": t.FULL, "sampled": t.SAMPLED}[spec_name]
    model, keys, starts, ends, src, dst = t.setup(seed, lengths)
    t.agreed_ranges(fault, starts, ends)
    device = torch.device("cuda", rank) if array in GPU_ARRAYS else torch.device("cpu")
    shapes = [(model.num_layers, 2, len(tokens), model.num_heads, model.strip) for tokens in model.tokens]
    if rank == 0:
        payload, wire = t.send(ab, fault, spec, model, keys, starts, ends, src)
        for kv, record in zip(payload, wire):
            dist.send(torch.from_numpy(kv).to(device), dst=1)
            framed = np.zeros(65, np.uint8)  # the record's 64 bytes and whether one was sent
            if record is not None:
                framed[:64], framed[64] = np.frombuffer(record, np.uint8), 1
            dist.send(torch.from_numpy(framed).to(device), dst=1)
        return None
    payload, wire = [], []
    for shape in shapes:
        kv = torch.empty(shape, dtype=torch.uint8, device=device)
        framed = torch.empty(65, dtype=torch.uint8, device=device)
        dist.recv(kv, src=0)
        dist.recv(framed, src=0)
        payload.append(kv.cpu().numpy())
        framed = framed.cpu().numpy()
        wire.append(framed[:64].tobytes() if framed[64] else None)
    verdicts, _ = t.receive(ab, fault, spec, model, keys, starts, ends, dst, payload, wire)
    return [v.name for v in verdicts]
