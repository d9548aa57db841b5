"""Memory snapshots held on other nodes too (issue 45): failure domains and placement
(`domains`), the replicas a rank holds for its peers (`store`), and the authenticated
TCP transport that moves them (`transport`). See docs/replicas.md."""

from __future__ import annotations

from resumable.replicas.domains import (
    RankPlace,
    Topology,
    check_replicas,
    copy_nodes,
    holder_nodes,
    peer_ranks,
    place_from_env,
    source_ranks,
    surviving_copy,
)
from resumable.replicas.store import Piece, Replica, ReplicaInfo, ReplicaStore, plan_pieces
from resumable.replicas.transport import (
    ReplicaClient,
    ReplicaServer,
    ServerFailure,
    TokenBucket,
    fetch_replica,
    push_replica,
)

__all__ = [
    "Piece",
    "RankPlace",
    "Replica",
    "ReplicaClient",
    "ReplicaInfo",
    "ReplicaServer",
    "ReplicaStore",
    "ServerFailure",
    "TokenBucket",
    "Topology",
    "check_replicas",
    "copy_nodes",
    "fetch_replica",
    "holder_nodes",
    "peer_ranks",
    "place_from_env",
    "plan_pieces",
    "push_replica",
    "source_ranks",
    "surviving_copy",
]
