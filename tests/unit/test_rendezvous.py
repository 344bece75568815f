"""The fetch rendezvous's header protocol, against a scripted second rank ([Note: fetch rendezvous])."""

from __future__ import annotations

import torch

from infinity.comm import Comm
from infinity.zero import collectives
from infinity.zero.rendezvous import FetchRendezvous

ASKING, DONE = 0, -2


def header(status: int, units: list[int], *, more: bool, width: int) -> torch.Tensor:
    row = torch.full((2 + width,), -1, dtype=torch.int64)
    row[0], row[1] = status, int(more)
    row[2 : 2 + len(units)] = torch.tensor(units, dtype=torch.int64)
    return row


def scripted_peer(monkeypatch, peer_rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Header all-gathers return this rank's row and the next scripted row of rank 1; returns the rows sent."""
    sent = []

    def all_gather_pieces(comm, flat, piece, *, async_op):
        assert not async_op
        sent.append(piece.clone())
        flat.copy_(torch.cat([piece, peer_rows[len(sent) - 1]]))
        return collectives.Pending(None)

    monkeypatch.setattr(collectives, "all_gather_pieces", all_gather_pieces)
    return sent


def test_ask_spans_rounds_until_no_rank_has_more(monkeypatch):
    rendezvous = FetchRendezvous(Comm(group=None, rank=0, world_size=2), widest_request=3)
    width = rendezvous.width
    assert width == 16  # the minimum
    wanted = list(range(40, 20, -1))  # 20 units: two rounds
    peer = [header(ASKING, [5, 40], more=False, width=width), header(ASKING, [], more=False, width=width)]
    sent = scripted_peer(monkeypatch, peer)
    assert rendezvous.ask(wanted) == [5, *range(21, 41)]  # the union, in unit order, each unit once
    assert [row.tolist() for row in sent] == [
        header(ASKING, wanted[:16], more=True, width=width).tolist(),
        header(ASKING, wanted[16:], more=False, width=width).tolist(),
    ]


def test_an_idle_rank_follows_a_peer_that_has_more(monkeypatch):
    rendezvous = FetchRendezvous(Comm(group=None, rank=0, world_size=2), widest_request=20)
    width = rendezvous.width
    assert width == 20  # the widest module's units fit in one round
    peer = [header(ASKING, list(range(20)), more=True, width=width), header(ASKING, [20], more=False, width=width)]
    sent = scripted_peer(monkeypatch, peer)
    assert rendezvous.ask([]) == list(range(21))
    assert len(sent) == 2


def test_drain_answers_until_every_rank_is_done(monkeypatch):
    rendezvous = FetchRendezvous(Comm(group=None, rank=0, world_size=2), widest_request=1)
    width = rendezvous.width
    peer = [
        header(ASKING, [7, 3], more=False, width=width),
        header(ASKING, [], more=False, width=width),  # asking, nothing listed: nothing to answer
        header(DONE, [], more=False, width=width),
    ]
    sent = scripted_peer(monkeypatch, peer)
    answered = []
    rendezvous.drain(answered.append)
    assert answered == [3, 7]
    assert [row.tolist() for row in sent] == [header(DONE, [], more=False, width=width).tolist()] * 3
