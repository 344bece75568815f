"""Memory tiers for training state. So far: the NVMe tier's per-rank swap store (not yet used by the engine)."""

from infinity.memory.nvme_store import (
    DirectionStats,
    NvmeStore,
    Segment,
    SegmentRequest,
    StoreStats,
    SwapLayout,
    default_run_id,
)
from infinity.memory.swap_lock import remove_stale_folders

__all__ = [
    "DirectionStats",
    "NvmeStore",
    "Segment",
    "SegmentRequest",
    "StoreStats",
    "SwapLayout",
    "default_run_id",
    "remove_stale_folders",
]
