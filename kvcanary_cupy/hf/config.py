"""The engine and model of a ``kvcanary hf`` run, and the canary's coverage options in it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HfEngineConfig:
    hidden_size: int = 64
    num_layers: int = 5  # one more than the four layers MAX_REAL_KV_SOURCES fingerprints: a layer the record does not read
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    block_size: int = 8
    num_blocks: int = 48
    max_batch_tokens: int = 32
    requests: int = 12
    max_new_tokens: int = 10
    sweep_every: int = 2
    # The canary's coverage past the 32-byte record (attach's options, docs/engines.md), on here as in
    # kvcanary sim: every layer's K and V fingerprinted, each slot re-checked within deep_check_period
    # steps (a flip outside the record's layers is seen), and the lost-store check.
    deep_kv_layers: object = "all"
    deep_check_period: int = 2
    check_lost_stores: bool = True

    def coverage_options(self) -> dict:
        """attach()'s coverage options of this run."""
        return dict(deep_kv_layers=self.deep_kv_layers, deep_check_period=self.deep_check_period,
                    check_lost_stores=self.check_lost_stores)

    @classmethod
    def sglang_coverage(cls, **kw) -> "HfEngineConfig":
        """The record's coverage alone (no deep fingerprints, no lost-store check), as SGLang's canary."""
        return cls(deep_kv_layers=None, check_lost_stores=False, **kw)
