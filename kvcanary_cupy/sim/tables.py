"""Engine tables: how the simulated engine hands its KV addressing to the canary.

The engine keeps, per request, a list of physical KV blocks.  Each addressing mode hands the
session its engine's own table, read natively by the plan:

- ``sglang``: SGLang's unified pool, ``kc.ReqToToken(req_to_token, virtual_to_physical=...,
  page_size=block_size)``: ``req_to_token`` int32 ``[bs + 1, L]`` holds *virtual* token ids (row 0
  the padding row), mapped to physical blocks by the pool's :class:`PageMap`, which compaction
  rebinds instead of rewriting the request's row;
- ``vllm``: ``kc.BlockTable(block_table, block_size, null_block=0)``, ``block_table`` int32
  ``[bs, max_blocks]``, one real row per batch request (rows 0 .. bs-1);
- ``flashinfer``: ``kc.PagedKvIndices(kv_indptr, kv_indices, block_size)``, rows are batch rows
  (``req_pool_indices`` is None).

Every mode addresses the same physical slots, so the canary's plans are byte for byte the same,
except where a request's list holds the null block (a zeroed entry): req_to_token and the block
table map it to the padding slot 0, but a CSR table has no null block, so it addresses page 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tables import BlockTable, PagedKvIndices, ReqToToken

ADDRESSING_MODES = ("sglang", "vllm", "flashinfer")
NULL_BLOCK = 0


class PageMap:
    """A pool's blocks as SGLang's unified pool sees them: each physical block is bound to a virtual
    page that stays in the requests' ``req_to_token`` rows while compaction moves the block.

    Both maps are permutations of the block ids (initially the identity): every virtual page is
    bound, and virtual page 0 (the null block) is physical block 0.
    """

    def __init__(self, num_blocks: int):
        self.virtual_to_physical = np.arange(num_blocks, dtype=np.int64)
        self.virtual_of = np.arange(num_blocks, dtype=np.int64)  # the inverse: physical -> virtual

    def rebind(self, old: int, new: int) -> None:
        """Block ``old``'s contents moved to the free block ``new``: its virtual page now maps to
        ``new``, and the free virtual page that mapped to ``new`` takes the vacated ``old``."""
        v, w = self.virtual_of[old], self.virtual_of[new]
        self.virtual_to_physical[v], self.virtual_to_physical[w] = new, old
        self.virtual_of[old], self.virtual_of[new] = w, v


@dataclass(frozen=True)
class SessionTable:
    """What one ``pre_forward`` / ``sweep`` call receives for a batch of ``bs`` rows."""

    req_pool_indices: np.ndarray | None  # int64 [bs]; None with a PagedKvIndices table
    table: object  # a kc.ReqToToken, kc.BlockTable or kc.PagedKvIndices
    expected_tokens: np.ndarray  # int32 [rows, L], rows indexed like the table's


def block_table(block_lists, width: int) -> np.ndarray:
    """vLLM's ``block_table`` of the given rows (int32 ``[bs, width]``, padded with the null block)."""
    out = np.full((len(block_lists), max(width, 1)), NULL_BLOCK, np.int32)
    for row, blocks in enumerate(block_lists):
        out[row, : len(blocks)] = blocks
    return out


def csr_pages(block_lists) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's ``(kv_indptr, kv_indices)`` of the given rows."""
    lengths = np.array([len(b) for b in block_lists], np.int64)
    indptr = np.zeros(len(block_lists) + 1, np.int32)
    np.cumsum(lengths, out=indptr[1:])
    indices = np.array([b for blocks in block_lists for b in blocks], np.int32)
    return indptr, indices


def virtual_req_to_token(block_lists, width: int, block_size: int, page_map: PageMap) -> np.ndarray:
    """SGLang's ``req_to_token`` of the given rows (row r becomes row r + 1; row 0 is padding):
    the virtual token ids of each block's virtual page, 0 (the padding slot) for the null block."""
    blocks = block_table(block_lists, width).astype(np.int64)
    tokens = page_map.virtual_of[blocks][:, :, None] * block_size + np.arange(block_size)
    tokens[blocks == NULL_BLOCK] = 0
    rtt = np.zeros((len(block_lists) + 1, blocks.shape[1] * block_size), np.int32)
    rtt[1:] = tokens.reshape(len(block_lists), -1)
    return rtt


def session_table(addressing: str, block_lists, token_lists, valid_lens, block_size: int, page_map: PageMap,
                  dev=lambda a: a) -> SessionTable:
    """The table, request rows and expected-token pool of one batch, in ``addressing``'s form, with
    every array put where the session runs by ``dev``.

    ``token_lists[r]`` holds the source-of-truth tokens of row r (at least ``valid_lens[r]``).
    """
    bs = len(block_lists)
    width = max((len(b) for b in block_lists), default=0)
    if addressing == "sglang":
        first_row = 1  # row 0 of req_to_token is the padding row
        table = ReqToToken(dev(virtual_req_to_token(block_lists, width, block_size, page_map)),
                           virtual_to_physical=dev(page_map.virtual_to_physical), page_size=block_size)
    elif addressing == "vllm":
        first_row = 0  # every block-table row is real
        table = BlockTable(dev(block_table(block_lists, width)), block_size, null_block=NULL_BLOCK)
    elif addressing == "flashinfer":
        first_row = 0  # the expected-token pool is indexed by batch row
        table = PagedKvIndices(*map(dev, csr_pages(block_lists)), block_size)
    else:
        raise ValueError(f"kvcanary sim: addressing must be one of {', '.join(ADDRESSING_MODES)}, got {addressing!r}")
    pool = np.zeros((first_row + bs, max(width * block_size, 1)), np.int32)
    for row, (tokens, n) in enumerate(zip(token_lists, valid_lens)):
        pool[first_row + row, :n] = tokens[:n]
    rows = None if addressing == "flashinfer" else np.arange(first_row, first_row + bs, dtype=np.int64)
    return SessionTable(None if rows is None else dev(rows), table, dev(pool))
