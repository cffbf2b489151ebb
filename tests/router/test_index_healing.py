"""The index heals: restarts, AllBlocksCleared, lost batches, digest drift; vLLM-like pods.

Our pods are real :class:`ZmqEventPublisher` s (restarted on the same ports); a vLLM-like
pod is ``VllmLikePod``: PUB + a replay ROUTER that answers as vLLM 0.32 does (batches from
the start seq, then the end marker; no digest), fed with vLLM's captured payloads.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from epdserve.connectors.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ZmqEventPublisher,
)
from epdserve.connectors.kv_events.digest import (
    DIGEST_REQUEST,
    StreamDigest,
)
from epdserve.router.index import STORE, PrefixIndex
from epdserve.router.keys import request_keys
from epdserve.router.metrics import RouterMetrics
from epdserve.router.subscriber import PodSubscriber

BS = 4
CAPTURES = Path("/work/shared/testdata/vllm-0.32/events")
END = (-1).to_bytes(8, "big", signed=True)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    ports = [s.bind(("127.0.0.1", 0)) or s.getsockname()[1] for s in socks]
    return [s.close() or p for s, p in zip(socks, ports, strict=True)]


def root_block(h: int, medium: str = "GPU") -> BlockStored:
    """A first block (no parent) whose tokens are derived from ``h``."""
    return BlockStored([h], None, [h % 1000 + i for i in range(BS)], BS, None, medium, None)


def wait_for(cond, timeout=8.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within timeout")
        time.sleep(0.02)


def sample(metrics: RouterMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value("epdserve_router:" + name, labels) or 0.0


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class OurPod:
    """A real publisher that can be restarted (a new process: new instance, seq from 0)."""

    def __init__(self, buffer_steps: int = 10_000):
        self.ports, self.buffer_steps = free_ports(2), buffer_steps
        self.pub = self._open()

    def _open(self) -> ZmqEventPublisher:
        events, replay = (f"tcp://*:{p}" for p in self.ports)
        return ZmqEventPublisher(events, replay, "t", buffer_steps=self.buffer_steps)

    def restart(self) -> None:
        self.pub.close()
        self.pub = self._open()

    def endpoints(self) -> tuple[str, str]:
        return tuple(f"tcp://127.0.0.1:{p}" for p in self.ports)


@pytest.fixture
def our_pod():
    pod = OurPod()
    yield pod
    pod.pub.close()


@pytest.fixture
def follow(ctx):
    started = []

    def start(endpoints, index, metrics, interval=0.1):
        sub = PodSubscriber(
            "p", *endpoints, index, metrics, ctx, replay_timeout=1.0, reconcile_interval=interval
        )
        sub.start()
        started.append(sub)
        return sub

    yield start
    for sub in started:  # every thread gone before the context is destroyed under it
        sub.stop(timeout=30)
        assert not sub._thread.is_alive()


def test_a_restarted_pod_that_sent_nothing_yet_is_dropped_by_its_new_instance(our_pod, follow):
    index, metrics = PrefixIndex(), RouterMetrics()
    our_pod.pub.publish([root_block(h) for h in (11, 12, 13)])
    follow(our_pod.endpoints(), index, metrics)
    wait_for(lambda: index.pod_block_count("p") == 3)
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 1)
    our_pod.restart()  # fewer batches than before (none): no seq ever goes back
    wait_for(lambda: index.pod_block_count("p") == 0)
    assert sample(metrics, "index_resyncs_total", pod="p", reason="restart") == 1
    our_pod.pub.publish([root_block(21)])
    wait_for(lambda: index.pod_block_count("p") == 1)
    index.check_integrity()


def test_a_restarted_pod_with_more_batches_than_before_keeps_only_its_new_blocks(our_pod, follow):
    index, metrics = PrefixIndex(), RouterMetrics()
    our_pod.pub.publish([root_block(11)])
    follow(our_pod.endpoints(), index, metrics)
    wait_for(lambda: index.pod_block_count("p") == 1)
    our_pod.restart()
    for h in (21, 22, 23, 24):  # seqs 0..3: past the old last seq, maybe before we reconnect
        our_pod.pub.publish([root_block(h)])
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 2)
    wait_for(lambda: index.pod_block_count("p") == 4)
    assert (
        sum(
            sample(metrics, "index_resyncs_total", pod="p", reason=r)
            for r in ("restart", "digest_mismatch")
        )
        >= 1
    )
    wanted = {h: [root_block(h)] for h in (11, 21, 24)}
    hits = {h: index.match(request_keys(b[0].token_ids, BS), ["p"])["p"] for h, b in wanted.items()}
    assert hits == {11: 0, 21: 1, 24: 1}


def test_all_blocks_cleared_drops_the_local_tier_keeps_the_store_and_counts_a_resync(
    our_pod, follow
):
    index, metrics = PrefixIndex(), RouterMetrics()
    follow(our_pod.endpoints(), index, metrics)
    our_pod.pub.publish([root_block(11), root_block(12), root_block(13, "STORE")])
    wait_for(lambda: index.pod_block_count("p") == 2 and index.pod_block_count("p", STORE) == 1)
    our_pod.pub.publish([AllBlocksCleared()])
    wait_for(lambda: index.pod_block_count("p") == 0)
    assert index.pod_block_count("p", STORE) == 1
    assert sample(metrics, "index_resyncs_total", pod="p", reason="cleared") == 1
    checks = sample(metrics, "index_checks_total", pod="p", outcome="ok")
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") > checks)
    assert sample(metrics, "index_checks_total", pod="p", outcome="mismatch") == 0


def test_a_router_joining_after_the_buffer_wrapped_adopts_the_pods_digest(follow):
    pod = OurPod(buffer_steps=2)
    try:
        for h in (11, 12, 13, 14):
            pod.pub.publish([root_block(h)])
        wait_for(lambda: pod.pub.stats.batches_published == 4)
        index, metrics = PrefixIndex(), RouterMetrics()
        sub = follow(pod.endpoints(), index, metrics)
        wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="adopted") == 1)
        assert sub.missed == 2 and index.pod_block_count("p") == 2  # seqs 2 and 3 only
        pod.pub.publish([BlockRemoved([11], "GPU"), root_block(15)])  # 11: never indexed
        wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 1)
        assert index.pod_block_count("p") == 3
    finally:
        pod.pub.close()


def test_a_digest_that_drifted_from_the_pods_triggers_a_resync_from_seq_0(our_pod, follow):
    index, metrics = PrefixIndex(), RouterMetrics()
    our_pod.pub.publish([root_block(11), root_block(12)])
    sub = follow(our_pod.endpoints(), index, metrics)
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 1)
    sub.digest = StreamDigest(((5, 1), (0, 0)))  # as if a batch were applied twice
    wait_for(lambda: sample(metrics, "index_resyncs_total", pod="p", reason="digest_mismatch"))
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 2)
    assert index.pod_block_count("p") == 2
    index.check_integrity()


def test_a_digest_that_differs_again_after_a_resync_is_adopted_not_replayed_forever(
    our_pod, follow
):
    index, metrics = PrefixIndex(), RouterMetrics()
    our_pod.pub.publish([root_block(11)])
    sub = follow(our_pod.endpoints(), index, metrics)
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 1)
    sub._decoder.decode = lambda payload: EventBatch(0.0, [root_block(99)])  # a codec fault
    our_pod.pub.publish([root_block(12)])
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="mismatch_again"))
    assert sample(metrics, "index_resyncs_total", pod="p", reason="digest_mismatch") == 1
    our_pod.pub.publish([root_block(13)])
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="mismatch_again") > 1)
    assert sample(metrics, "index_resyncs_total", pod="p", reason="digest_mismatch") == 1


class VllmLikePod:
    """PUB + replay ROUTER as vLLM 0.32 answers: no digest, no instance id."""

    def __init__(self, ctx: zmq.Context):
        self.ports = free_ports(2)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.ports[0]}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.ports[1]}")
        self.buffer: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if self.router.poll(20):
                ident, _, start = self.router.recv_multipart()
                start = int.from_bytes(start, "big")  # unsigned, as vLLM reads it
                held = dict(self.buffer)  # the test may swap the buffer meanwhile
                for seq in sorted(s for s in held if s >= start):
                    frames = [ident, b"", b"t", seq.to_bytes(8, "big"), held[seq]]
                    self.router.send_multipart(frames)
                self.router.send_multipart([ident, b"", b"", END, b""])

    def endpoints(self) -> tuple[str, str]:
        return tuple(f"tcp://127.0.0.1:{p}" for p in self.ports)

    def close(self):
        self._stop.set()
        self._thread.join(30)
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
def vllm_pod(ctx):
    pod = VllmLikePod(ctx)
    yield pod
    pod.close()


def captured(seq: int) -> bytes:
    return (CAPTURES / f"seq-{seq:06d}.bin").read_bytes()


def test_a_vllm_pod_has_no_digest_and_a_restart_is_seen_by_the_tail_probe(vllm_pod, follow):
    for seq in range(3):
        vllm_pod.buffer[seq] = captured(seq)
    index, metrics = PrefixIndex(), RouterMetrics()
    follow(vllm_pod.endpoints(), index, metrics)
    wait_for(lambda: index.pod_block_count("p") > 0)
    wait_for(lambda: sample(metrics, "index_checks_total", pod="p", outcome="ok") >= 1)
    assert sample(metrics, "index_checks_total", pod="p", outcome="unsupported") == 1
    vllm_pod.buffer.clear()  # a new process that has published nothing yet
    wait_for(lambda: index.pod_block_count("p") == 0)
    assert sample(metrics, "index_resyncs_total", pod="p", reason="restart") == 1


def test_a_vllm_pod_restarted_with_other_batches_at_the_same_seqs_is_resynced(vllm_pod, follow):
    vllm_pod.buffer[0] = captured(0)
    index, metrics = PrefixIndex(), RouterMetrics()
    follow(vllm_pod.endpoints(), index, metrics)
    wait_for(lambda: index.pod_block_count("p") > 0)
    first = index.pod_block_count("p")
    vllm_pod.buffer = {0: captured(1), 1: captured(2)}  # more batches, none sent live to us
    wait_for(lambda: sample(metrics, "index_resyncs_total", pod="p", reason="restart") == 1)
    wait_for(lambda: index.pod_block_count("p") not in (0, first))


def test_a_vllm_replay_server_answers_a_digest_request_with_the_end_marker_only(vllm_pod, ctx):
    vllm_pod.buffer[0] = captured(0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(vllm_pod.endpoints()[1])
    dealer.send_multipart([b"", DIGEST_REQUEST])
    assert dealer.poll(5000)
    assert dealer.recv_multipart() == [b"", b"", END, b""]
    dealer.close(0)
