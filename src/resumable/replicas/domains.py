"""Failure domains and replica placement: which node a rank runs on, and which ranks
hold the copies of its memory snapshot.

A failure domain is a node: a hardware fault takes a machine and every rank's
``/dev/shm`` on it. A node's identity is torchrun's ``GROUP_RANK``, or the host name
only when no launcher set it.

Placement is a ring over nodes. With ``replicas=R`` copies in all (the own one counts),
nodes ``n+1 .. n+R-1`` (mod the number of nodes) hold node ``n``'s snapshots. Each copy
sits on the rank of the same local rank. Contract: any ``R - 1`` nodes may be lost and
every snapshot still has a copy. The trade-off: a ring spreads the receiving load evenly,
but knows no racks or switches. A larger blast radius than one node is not modelled yet.

Everything below is pure: no collectives, no environment read except in `place_from_env`.
Why: docs/decisions.md, "Module notes moved from docstrings".
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resumable.errors import ReplicaPlacementError


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs. ``node`` is the node's identity: ``"group-<GROUP_RANK>"``
    under torchrun, else ``"host-<hostname>"``; ranks with equal ``node`` share a
    failure domain."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ReplicaPlacementError(
            f"environment variable {name} should be an integer, found {raw!r}; "
            "launch with torchrun or set it to this process's value"
        ) from None
    if value < 0:
        raise ReplicaPlacementError(f"environment variable {name} is negative ({value})")
    return value


def place_from_env(
    env: Mapping[str, str] | None = None, *, hostname: str | None = None
) -> RankPlace:
    """This rank's place from torchrun's variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``); without ``GROUP_RANK`` the
    node is this host's name. A single process without a launcher is rank 0 of 1."""
    env = os.environ if env is None else env
    rank = _int(env, "RANK", 0)
    world = _int(env, "WORLD_SIZE", 1)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    if not rank < world or not local_rank < local_world:
        raise ReplicaPlacementError(
            f"expected RANK < WORLD_SIZE and LOCAL_RANK < LOCAL_WORLD_SIZE, found "
            f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} "
            f"LOCAL_WORLD_SIZE={local_world}; check the launcher's environment"
        )
    group = env.get("GROUP_RANK")
    if group not in (None, ""):
        node = f"group-{_int(env, 'GROUP_RANK', 0)}"
    else:
        node = f"host-{hostname if hostname is not None else socket.gethostname()}"
    return RankPlace(rank, world, local_rank, local_world, node)


@dataclass(frozen=True)
class Topology:
    """The job's nodes and which rank is which local rank on which node, from every
    rank's `RankPlace` (gathered by the caller, for example through the rendezvous
    store). Nodes are numbered in the order of their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]  # nodes[i]: global ranks on node i, by local rank
    node_of: tuple[int, ...]  # node_of[rank]: its node's index
    local_of: tuple[int, ...]  # local_of[rank]: its index within its node

    @classmethod
    def from_places(cls, places: Sequence[RankPlace]) -> Topology:
        if not places:
            raise ReplicaPlacementError("expected the places of at least one rank, found none")
        by_rank = sorted(places, key=lambda p: p.rank)
        if [p.rank for p in by_rank] != list(range(len(by_rank))):
            raise ReplicaPlacementError(
                f"expected one place for each rank 0..{len(by_rank) - 1}, found ranks "
                f"{[p.rank for p in by_rank]}; gather every rank's place before placing"
            )
        names: dict[str, int] = {}
        members: list[list[RankPlace]] = []
        for p in by_rank:
            if p.node not in names:
                names[p.node] = len(members)
                members.append([])
            members[names[p.node]].append(p)
        nodes: list[tuple[int, ...]] = []
        node_of = [0] * len(by_rank)
        local_of = [0] * len(by_rank)
        for index, group in enumerate(members):
            group.sort(key=lambda p: (p.local_rank, p.rank))
            locals_ = [p.local_rank for p in group]
            if len(set(locals_)) != len(locals_):
                raise ReplicaPlacementError(
                    f"node {group[0].node!r} has two ranks with one local rank "
                    f"({locals_}); two simulated nodes on one host need GROUP_RANK set"
                )
            nodes.append(tuple(p.rank for p in group))
            for position, p in enumerate(group):
                node_of[p.rank] = index
                local_of[p.rank] = position
        return cls(tuple(nodes), tuple(node_of), tuple(local_of))

    @classmethod
    def uniform(cls, n_nodes: int, per_node: int) -> Topology:
        """``n_nodes`` nodes of ``per_node`` ranks each, ranks numbered node by node
        (torchrun's numbering with equal ``--nproc-per-node``)."""
        if n_nodes < 1 or per_node < 1:
            raise ReplicaPlacementError(
                f"expected at least one node of at least one rank, found {n_nodes} x {per_node}"
            )
        places = [
            RankPlace(n * per_node + i, n_nodes * per_node, i, per_node, f"group-{n}")
            for n in range(n_nodes)
            for i in range(per_node)
        ]
        return cls.from_places(places)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)


def check_replicas(replicas: int, n_nodes: int) -> None:
    """Refuse a replica count that cannot be placed on ``n_nodes`` distinct nodes."""
    if replicas < 1:
        raise ReplicaPlacementError(
            f"replicas counts the copies of each snapshot, the node's own included: "
            f"expected 1 or more, found {replicas}"
        )
    if replicas > n_nodes:
        raise ReplicaPlacementError(
            f"replicas={replicas} needs {replicas} distinct nodes (failure domains), "
            f"found {n_nodes}; use replicas={n_nodes} or fewer, or launch on more nodes"
        )


def holder_nodes(node: int, n_nodes: int, replicas: int) -> list[int]:
    """The nodes holding copies of ``node``'s snapshots besides itself: the
    ``replicas - 1`` next nodes in ring order."""
    check_replicas(replicas, n_nodes)
    if not 0 <= node < n_nodes:
        raise ReplicaPlacementError(f"expected a node index in 0..{n_nodes - 1}, found {node}")
    return [(node + k) % n_nodes for k in range(1, replicas)]


def copy_nodes(node: int, n_nodes: int, replicas: int) -> list[int]:
    """Every node holding a copy of ``node``'s snapshots, itself first."""
    return [node, *holder_nodes(node, n_nodes, replicas)]


def _rank_at(topology: Topology, node: int, local: int) -> int:
    members = topology.nodes[node]
    return members[local % len(members)]


def peer_ranks(rank: int, topology: Topology, replicas: int) -> list[int]:
    """The ranks ``rank`` sends its snapshot to: on each holder node, the rank with the
    same local rank (or, on a node with fewer ranks, that local rank modulo its size)."""
    if not 0 <= rank < len(topology.node_of):
        raise ReplicaPlacementError(
            f"expected a rank in 0..{len(topology.node_of) - 1}, found {rank}"
        )
    node, local = topology.node_of[rank], topology.local_of[rank]
    return [_rank_at(topology, h, local) for h in holder_nodes(node, topology.n_nodes, replicas)]


def source_ranks(rank: int, topology: Topology, replicas: int) -> list[int]:
    """The ranks whose snapshots ``rank`` holds (the inverse of `peer_ranks`)."""
    return [
        src
        for src in range(len(topology.node_of))
        if src != rank and rank in peer_ranks(src, topology, replicas)
    ]


def surviving_copy(node: int, lost: set[int], n_nodes: int, replicas: int) -> int | None:
    """A node that still holds ``node``'s snapshot after the nodes in ``lost`` are
    gone (its own first), or None when every copy was lost."""
    for holder in copy_nodes(node, n_nodes, replicas):
        if holder not in lost:
            return holder
    return None
