"""Failure domains and ring placement of replicas (resumable.replicas.domains): pure
functions, checked as properties over many layouts."""

from __future__ import annotations

import itertools

import pytest

from resumable.errors import ReplicaPlacementError
from resumable.replicas.domains import (
    RankPlace,
    Topology,
    copy_nodes,
    holder_nodes,
    peer_ranks,
    place_from_env,
    source_ranks,
    surviving_copy,
)


def _env(group: int | None, local: int, per_node: int, nodes: int) -> dict[str, str]:
    env = {
        "RANK": str((group or 0) * per_node + local),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
    }
    if group is not None:
        env["GROUP_RANK"] = str(group)
    return env


def test_group_rank_names_the_node_not_the_host() -> None:
    """Two simulated nodes on one host are two failure domains."""
    a = place_from_env(_env(0, 1, 2, 2), hostname="same-host")
    b = place_from_env(_env(1, 1, 2, 2), hostname="same-host")
    assert a.node == "group-0" and b.node == "group-1"
    assert (a.rank, a.local_rank, a.local_world_size, a.world_size) == (1, 1, 2, 4)
    assert b.rank == 3
    topo = Topology.from_places(
        [place_from_env(_env(g, i, 2, 2), hostname="h") for g in (1, 0) for i in (1, 0)]
    )
    assert topo.nodes == ((0, 1), (2, 3))


def test_host_name_without_a_launcher() -> None:
    place = place_from_env({}, hostname="box")
    assert place == RankPlace(0, 1, 0, 1, "host-box")
    assert place_from_env({"GROUP_RANK": ""}, hostname="box").node == "host-box"


def test_bad_environment_is_refused_with_what_was_found() -> None:
    with pytest.raises(ReplicaPlacementError, match="GROUP_RANK should be an integer"):
        place_from_env({"GROUP_RANK": "x"})
    with pytest.raises(ReplicaPlacementError, match="RANK=4 WORLD_SIZE=4"):
        place_from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_one_host_without_group_rank_cannot_pass_for_two_nodes() -> None:
    places = [RankPlace(r, 2, 0, 1, "host-h") for r in range(2)]
    with pytest.raises(ReplicaPlacementError, match="GROUP_RANK"):
        Topology.from_places(places)


def test_more_replicas_than_nodes_is_refused() -> None:
    with pytest.raises(ReplicaPlacementError, match=r"replicas=3 needs 3 distinct nodes.*found 2"):
        holder_nodes(0, 2, 3)
    with pytest.raises(ReplicaPlacementError, match="expected 1 or more"):
        holder_nodes(0, 2, 0)
    with pytest.raises(ReplicaPlacementError, match="replicas=4"):
        peer_ranks(0, Topology.uniform(3, 2), 4)


def test_ring_order() -> None:
    assert holder_nodes(0, 4, 2) == [1]
    assert holder_nodes(3, 4, 3) == [0, 1]
    assert holder_nodes(2, 4, 1) == []
    topo = Topology.uniform(3, 2)  # ranks 0,1 | 2,3 | 4,5
    assert peer_ranks(1, topo, 2) == [3]
    assert peer_ranks(5, topo, 3) == [1, 3]
    assert source_ranks(1, topo, 2) == [5]


@pytest.mark.parametrize("n_nodes", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("per_node", [1, 2, 3])
def test_placement_properties(n_nodes: int, per_node: int) -> None:
    topo = Topology.uniform(n_nodes, per_node)
    for replicas in range(1, n_nodes + 1):
        # every node's copies sit on `replicas` distinct nodes
        for node in range(n_nodes):
            copies = copy_nodes(node, n_nodes, replicas)
            assert len(set(copies)) == replicas and copies[0] == node
        # each rank sends to one peer rank per extra copy, on another node, same local rank,
        # and every rank receives as many as it sends (the load is even)
        received = dict.fromkeys(range(n_nodes * per_node), 0)
        for rank in range(n_nodes * per_node):
            peers = peer_ranks(rank, topo, replicas)
            assert len(peers) == replicas - 1
            assert len({topo.node_of[p] for p in peers} | {topo.node_of[rank]}) == replicas
            assert all(topo.local_of[p] == topo.local_of[rank] for p in peers)
            for p in peers:
                received[p] += 1
            assert sorted(source_ranks(rank, topo, replicas)) == sorted(
                r for r in range(n_nodes * per_node) if rank in peer_ranks(r, topo, replicas)
            )
        assert set(received.values()) == {replicas - 1}
        # losing any replicas-1 nodes leaves a copy of every node; losing `replicas` may not
        for lost in itertools.combinations(range(n_nodes), replicas - 1):
            for node in range(n_nodes):
                holder = surviving_copy(node, set(lost), n_nodes, replicas)
                assert holder is not None and holder not in lost
                assert holder in copy_nodes(node, n_nodes, replicas)
        if replicas < n_nodes:
            lost_all = set(copy_nodes(0, n_nodes, replicas))
            assert surviving_copy(0, lost_all, n_nodes, replicas) is None


def test_uneven_nodes_still_place_on_distinct_nodes() -> None:
    places = [
        RankPlace(0, 5, 0, 3, "group-0"),
        RankPlace(1, 5, 1, 3, "group-0"),
        RankPlace(2, 5, 2, 3, "group-0"),
        RankPlace(3, 5, 0, 2, "group-1"),
        RankPlace(4, 5, 1, 2, "group-1"),
    ]
    topo = Topology.from_places(places)
    assert peer_ranks(2, topo, 2) == [3]  # local rank 2 mod 2 on the smaller node
    assert all(topo.node_of[p] != topo.node_of[r] for r in range(5) for p in peer_ranks(r, topo, 2))
