"""Resume the data position exactly, on one process or several ranks.

`ResumableDataLoader` is a ``torch.utils.data.DataLoader`` (same arguments, same defaults)
whose position is a few JSON values; `ResumableSampler` is the seeded, sharded order it
reads by default, usable on its own. `resumable.data.order` explains how a position stays
valid across a change of world size; `resumable.data.loader` how user samplers are resumed.
"""

from resumable.data.loader import ResumableDataLoader
from resumable.data.order import ResumableSampler

__all__ = ["ResumableDataLoader", "ResumableSampler"]
