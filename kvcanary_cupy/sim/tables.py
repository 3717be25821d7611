"""Engine tables: how the simulated engine hands its KV addressing to the canary.

The engine keeps, per request, a list of KV blocks (vLLM's block table row).  Each addressing
mode builds its engine's native structure from those lists:

- ``sglang``: ``req_to_token`` int32 ``[bs + 1, L]``, a slot per token, row 0 the padding row;
- ``vllm``: ``block_table`` int32 ``[bs, max_blocks]``, every row real, block 0 the null block;
- ``flashinfer``: CSR ``kv_indptr`` int32 ``[bs + 1]`` and ``kv_indices`` int32 (the pages).

:func:`session_table` turns the native structure into what the session's ``plan`` accepts.  Until
``kc.BlockTable`` / ``kc.PagedKvIndices`` exist, block tables and CSR tables are materialised into
the equivalent ``req_to_token`` there (rows shifted by one, the null block / a missing page
written as slot 0): the only place to change when they land.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ADDRESSING_MODES = ("sglang", "vllm", "flashinfer")
NULL_BLOCK = 0


@dataclass(frozen=True)
class SessionTable:
    """What one ``pre_forward`` / ``sweep`` call receives for a batch of ``bs`` rows."""

    req_pool_indices: np.ndarray  # int64 [bs]
    table: object  # what plan accepts
    expected_tokens: np.ndarray  # int32 [rows, L], rows indexed like req_pool_indices


def block_table(block_lists, width: int) -> np.ndarray:
    """vLLM's ``block_table`` of the given rows (int32 ``[bs, width]``, padded with the null block)."""
    out = np.zeros((len(block_lists), max(width, 1)), np.int32)
    for row, blocks in enumerate(block_lists):
        out[row, : len(blocks)] = blocks
    return out


def materialise_block_table(table: np.ndarray, block_size: int) -> np.ndarray:
    """The ``req_to_token`` equivalent to a block table: row r becomes row r + 1 (row 0 is
    padding) and every token of the null block addresses the padding slot 0."""
    bs, width = table.shape
    slots = table.astype(np.int64)[:, :, None] * block_size + np.arange(block_size)
    slots[table == NULL_BLOCK] = 0
    rtt = np.zeros((bs + 1, width * block_size), np.int32)
    rtt[1:] = slots.reshape(bs, width * block_size)
    return rtt


def csr_pages(block_lists) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's ``(kv_indptr, kv_indices)`` of the given rows."""
    lengths = np.array([len(b) for b in block_lists], np.int64)
    indptr = np.zeros(len(block_lists) + 1, np.int32)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.array([b for blocks in block_lists for b in blocks], np.int32)
    return indptr, indices


def materialise_csr(indptr: np.ndarray, indices: np.ndarray, page_size: int) -> np.ndarray:
    """The ``req_to_token`` equivalent to a CSR page table (batch row r becomes row r + 1)."""
    lists = [indices[indptr[r]: indptr[r + 1]] for r in range(indptr.shape[0] - 1)]
    width = max((len(x) for x in lists), default=0)
    return materialise_block_table(block_table(lists, width), page_size)


def session_table(addressing: str, block_lists, token_lists, valid_lens, block_size: int) -> SessionTable:
    """The table, request rows and expected-token pool of one batch, in ``addressing``'s form.

    ``token_lists[r]`` holds the source-of-truth tokens of row r (at least ``valid_lens[r]``).
    """
    bs = len(block_lists)
    width = max((len(b) for b in block_lists), default=0)
    if addressing == "sglang":
        table = materialise_block_table(block_table(block_lists, width), block_size)  # the engine's own req_to_token
    elif addressing == "vllm":
        table = materialise_block_table(block_table(block_lists, width), block_size)  # swap: kc.BlockTable(...)
    elif addressing == "flashinfer":
        table = materialise_csr(*csr_pages(block_lists), block_size)  # swap: kc.PagedKvIndices(...)
    else:
        raise ValueError(f"kvcanary sim: addressing must be one of {', '.join(ADDRESSING_MODES)}, got {addressing!r}")
    pool = np.zeros((bs + 1, max(width * block_size, 1)), np.int32)
    for row, (tokens, n) in enumerate(zip(token_lists, valid_lens)):
        pool[row + 1, :n] = tokens[:n]
    return SessionTable(np.arange(1, bs + 1, dtype=np.int64), table, pool)
