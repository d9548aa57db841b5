"""Several processes: the names other modules import, gathered from where they live.

`resumable.group` (the ranks and the side gloo group), `resumable.pieces` (global
tensors and their pieces) and `resumable.reshard` (filling live tensors from pieces).
"""

from resumable.group import DEFAULT_TIMEOUT_S, Group, current_group
from resumable.pieces import (
    GlobalTensor,
    Piece,
    StoredPiece,
    balance,
    check_pieces,
    dtensor_piece,
    global_tensors,
    is_dtensor,
    owned_tensors,
    piece_name,
    pieces_from_json,
    pieces_to_json,
)
from resumable.reshard import GlobalLoader, shaped_like

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "GlobalLoader",
    "GlobalTensor",
    "Group",
    "Piece",
    "StoredPiece",
    "balance",
    "check_pieces",
    "current_group",
    "dtensor_piece",
    "global_tensors",
    "is_dtensor",
    "owned_tensors",
    "piece_name",
    "pieces_from_json",
    "pieces_to_json",
    "shaped_like",
]
