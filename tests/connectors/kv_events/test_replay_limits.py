"""Replay bounds: capped answers, one answer in flight per peer, a bound on peers served at
once, and oversize messages that cost only their sender its connection.

Answers that must stay in flight are made too big to fit the socket buffers (ipc, a
reader that has not started reading), so no test depends on timing.
"""

from __future__ import annotations

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from epdserve.connectors.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher
from epdserve.connectors.kv_events.sockets import MAX_REQUEST_BYTES

END = (-1).to_bytes(8, "big", signed=True)
BIG_BLOCKS = 64  # ~3 KB per batch: 1,000 of them never fit the buffers in front of a reader


def big_event(i: int) -> BlockStored:
    tokens = [(i + t) % 4000 for t in range(BIG_BLOCKS * 16)]
    return BlockStored(list(range(i, i + BIG_BLOCKS)), None, tokens, 16, None, "GPU", None, None, 0)


@pytest.fixture
def make_publisher(tmp_path, wait_for):
    made = []

    def make(batches: int, big: bool = False, **options) -> ZmqEventPublisher:
        n = len(made)
        publisher = ZmqEventPublisher(
            f"ipc://{tmp_path}/ev{n}", f"ipc://{tmp_path}/replay{n}", "t", **options
        )
        publisher.replay_url = f"ipc://{tmp_path}/replay{n}"
        made.append(publisher)
        for i in range(batches):
            publisher.publish([big_event(i) if big else BlockRemoved([i], "GPU")])
        wait_for(lambda: publisher.stats.batches_published == batches, what="published")
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def dealer(ctx, url: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.connect(url)
    return sock


def ask(sock: zmq.Socket, start: int) -> None:
    sock.send_multipart([b"", start.to_bytes(8, "big")])


def read_answers(sock: zmq.Socket, answers: int = 1) -> tuple[list[int], int]:
    """Batches' seqs and end markers read until ``answers`` end markers arrived."""
    seqs, ends = [], 0
    while ends < answers:
        assert sock.poll(10_000), "replay answer stopped"
        _, _, seq, _ = sock.recv_multipart()
        if seq == END:
            ends += 1
        else:
            seqs.append(int.from_bytes(seq, "big"))
    return seqs, ends


def test_each_answer_is_capped_and_ends_with_the_marker(make_publisher, ctx):
    publisher = make_publisher(25, buffer_steps=100, replay_max_batches=10)
    sock = dealer(ctx, publisher.replay_url)
    got = []
    for start in (0, 10, 20):
        ask(sock, start)
        got.append(read_answers(sock)[0])
    assert got == [list(range(0, 10)), list(range(10, 20)), list(range(20, 25))]
    assert publisher.stats.replay_answers_capped == 2


def test_a_peer_with_an_answer_in_flight_gets_no_second_one(make_publisher, ctx, wait_for):
    publisher = make_publisher(1000, big=True, buffer_steps=1000)
    sock = dealer(ctx, publisher.replay_url)
    ask(sock, 0)
    wait_for(lambda: publisher.stats.replay_requests == 1, what="first request taken")
    ask(sock, 0)  # the first answer cannot have finished: nothing was read yet
    wait_for(lambda: publisher.stats.replay_requests == 2, what="second request taken")
    assert publisher.stats.replay_requests_busy == 1
    seqs, _ = read_answers(sock)
    assert seqs == list(range(1000)) and not sock.poll(200)  # one answer, not two
    ask(sock, 990)  # done now: the peer is served again
    assert read_answers(sock)[0] == list(range(990, 1000))
    assert publisher.stats.replay_requests_busy == 1


def test_peers_beyond_the_bound_are_refused_until_one_is_done(make_publisher, ctx, wait_for):
    publisher = make_publisher(1000, big=True, buffer_steps=1000, replay_max_in_flight=1)
    first, second = dealer(ctx, publisher.replay_url), dealer(ctx, publisher.replay_url)
    ask(first, 0)
    wait_for(lambda: publisher.stats.replay_requests == 1, what="first request taken")
    ask(second, 0)
    wait_for(lambda: publisher.stats.replay_requests_refused == 1, what="second refused")
    assert len(read_answers(first)[0]) == 1000
    ask(second, 995)
    assert read_answers(second)[0] == list(range(995, 1000))


def wait_disconnected(monitor: zmq.Socket) -> None:
    while monitor.poll(10_000):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return
    raise AssertionError("the peer was not disconnected")


def test_an_oversize_replay_request_costs_only_its_sender_the_connection(make_publisher, ctx):
    publisher = make_publisher(5)
    big = dealer(ctx, publisher.replay_url)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big.send_multipart([b"", b"x" * (MAX_REQUEST_BYTES + 1)])
    wait_disconnected(monitor)
    other = dealer(ctx, publisher.replay_url)
    ask(other, 0)
    assert read_answers(other)[0] == [0, 1, 2, 3, 4]
    assert publisher.stats.replay_requests == 1  # the oversize one never reached us


def test_a_request_of_many_frames_is_counted_invalid_and_replays_go_on(make_publisher, ctx):
    publisher = make_publisher(3)
    sock = dealer(ctx, publisher.replay_url)
    sock.send_multipart([b""] * 1000 + [(0).to_bytes(8, "big")])
    ask(sock, 0)
    assert read_answers(sock)[0] == [0, 1, 2]
    assert publisher.stats.replay_requests_invalid == 1


def test_an_oversize_subscription_drops_that_subscriber_only(make_publisher, ctx, tmp_path):
    publisher = make_publisher(0)
    url = f"ipc://{tmp_path}/ev0"
    good = ctx.socket(zmq.SUB)
    good.setsockopt(zmq.SUBSCRIBE, b"")
    good.connect(url)
    bad = ctx.socket(zmq.SUB)
    monitor = bad.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    bad.setsockopt(zmq.SUBSCRIBE, b"t" * (MAX_REQUEST_BYTES + 1))
    bad.connect(url)
    wait_disconnected(monitor)
    for i in range(300):  # slow joiner: probe until the good one hears
        publisher.publish([BlockRemoved([i], "GPU")])
        if good.poll(30):
            break
    assert good.recv_multipart()[0] == b"t"
    bad.close(0)
    good.close(0)
