"""``kvcanary hf``: the canary inside Hugging Face transformers' real continuous-batching engine, with
faults injected the way real bugs happen (:mod:`.faults`), measured and reported like ``kvcanary sim``
(:mod:`.runner`).  Needs transformers and torch: ``pip install kvcanary-cupy[transformers]``."""

from .faults import FAULTS
from .config import HfEngineConfig
from .runner import CLEAN_CONFIGS, HfConfig, HfResult, run

__all__ = ["CLEAN_CONFIGS", "FAULTS", "HfConfig", "HfEngineConfig", "HfResult", "run"]
