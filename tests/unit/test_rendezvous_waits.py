"""The fetch rendezvous's two waits around gradient reductions, against a scripted second rank ([Note: fetch
rendezvous], [Note: launch order] in zero/reducer.py): both keep answering the peer's fetches until it is there."""

from __future__ import annotations

from infinity.comm import Comm
from infinity.zero.rendezvous import FetchRendezvous
from tests.unit.test_rendezvous import ASKING, DONE, header, scripted_peer

AGREEING, WAITING = -3, -4


def rendezvous() -> FetchRendezvous:
    return FetchRendezvous(Comm(group=None, rank=0, world_size=2), widest_request=1)


def test_agree_answers_fetches_until_every_rank_agrees(monkeypatch):
    width = rendezvous().width
    peer = [
        header(ASKING, [4, 2], more=False, width=width),  # the peer is still in its forward
        header(AGREEING, [77], more=False, width=width),
    ]
    sent = scripted_peer(monkeypatch, peer)
    answered = []
    assert rendezvous().agree(12, answered.append) == [12, 77]
    assert answered == [2, 4]  # the agreeing row's value is no unit
    assert [row.tolist() for row in sent] == [header(AGREEING, [12], more=False, width=width).tolist()] * 2


def test_wait_needs_every_rank_to_have_launched_the_reduction(monkeypatch):
    """Waiting for this backward's 3rd reduction, having launched 4: a peer that is fetching (count unknown), then
    waiting with 2 launched, is answered; the peer waiting with 3 launched, or done with its pass, ends it."""
    width = rendezvous().width
    for last in (header(WAITING, [3], more=False, width=width), header(DONE, [], more=False, width=width)):
        peer = [header(ASKING, [5], more=False, width=width), header(WAITING, [2], more=False, width=width), last]
        sent = scripted_peer(monkeypatch, peer)
        answered = []
        rendezvous().wait(4, 3, answered.append)
        assert answered == [5]
        assert [row.tolist() for row in sent] == [header(WAITING, [4], more=False, width=width).tolist()] * 3


def test_a_draining_rank_answers_a_waiting_one(monkeypatch):
    """The drain goes on while a peer waits: only every rank done ends it."""
    width = rendezvous().width
    peer = [header(WAITING, [1], more=False, width=width), header(DONE, [], more=False, width=width)]
    sent = scripted_peer(monkeypatch, peer)
    answered = []
    rendezvous().drain(answered.append)
    assert answered == [] and len(sent) == 2
