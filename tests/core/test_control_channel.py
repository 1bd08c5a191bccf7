"""The control channel under concurrent senders: every thread sends on the sockets itself
(under one lock), the I/O thread only reads. Nothing may be lost, reordered per sender
or left waiting for the next tick (ticks here are 30 s apart: a message whose wake-up
was lost would stall the test past its 20 s wait)."""

from __future__ import annotations

import queue
import threading
import time

from kvbridge.common.control import ControlChannel

THREADS, PER_THREAD, TICK_S = 4, 300, 30.0


def _wait_for(cond, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def test_concurrent_senders_both_ways_lose_and_reorder_nothing():
    served: list[tuple[str, bytes]] = []
    echoed: list[bytes] = []
    lock = threading.Lock()

    replies: queue.SimpleQueue = queue.SimpleQueue()

    def on_server(peer: str, payload: bytes) -> None:  # the prefill side: a worker echoes each message
        with lock:
            served.append((peer, payload))
        replies.put((peer, b"echo:" + payload))

    def echo_worker() -> None:  # sends on the ROUTER while the server's I/O thread reads it
        while (item := replies.get()) is not None:
            server.send(*item)

    def on_client(peer: str, payload: bytes) -> None:
        with lock:
            echoed.append(payload)

    server = ControlChannel(on_server, bind_host="127.0.0.1", tick_s=TICK_S, name="test-server")
    client = ControlChannel(on_client, tick_s=TICK_S, name="test-client")
    echoer = threading.Thread(target=echo_worker)
    echoer.start()
    try:
        start = threading.Barrier(THREADS)

        def sender(t: int) -> None:
            start.wait()  # the first messages race the DEALER's creation on the I/O thread
            for i in range(PER_THREAD):
                client.send(server.endpoint, f"{t}:{i}".encode())

        threads = [threading.Thread(target=sender, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        total = THREADS * PER_THREAD
        assert _wait_for(lambda: len(echoed) == total), f"{len(served)} served, {len(echoed)} echoed of {total}"
        with lock:
            got = [p for _, p in served]
            peers = {peer for peer, _ in served}
            back = list(echoed)
        assert len(peers) == 1  # one DEALER per endpoint, whichever thread sent
        for t in range(THREADS):  # each sender's messages arrive, and come back, in its order
            mine = [int(p.split(b":")[1]) for p in got if p.startswith(f"{t}:".encode())]
            assert mine == list(range(PER_THREAD)), f"thread {t}: {mine[:10]}..."
            echo = [int(p.split(b":")[2]) for p in back if p.startswith(f"echo:{t}:".encode())]
            assert echo == list(range(PER_THREAD)), f"thread {t} echoes: {echo[:10]}..."
    finally:
        replies.put(None)
        echoer.join()
        client.close()
        server.close()


def test_send_after_close_is_dropped_quietly():
    ch = ControlChannel(lambda peer, payload: None, bind_host="127.0.0.1", tick_s=TICK_S)
    ch.close()
    ch.send("tcp://127.0.0.1:1", b"late")  # neither raises nor blocks
    ch.send("00ff", b"late")


def test_pending_sees_an_unread_message_and_loses_none():
    """``pending()`` (asked by a sender worker to decide whether to stop optional work) is
    True while a message waits unread, and asking does not strand it: with ticks 30 s
    apart, the I/O thread must still read it as soon as it is free."""
    got: list[bytes] = []
    first_in, release = threading.Event(), threading.Event()

    def on_server(peer: str, payload: bytes) -> None:
        got.append(payload)
        if payload == b"first":  # keep the I/O thread busy while the second message arrives
            first_in.set()
            release.wait(10)

    server = ControlChannel(on_server, bind_host="127.0.0.1", tick_s=TICK_S, name="test-pending")
    client = ControlChannel(lambda p, m: None, tick_s=TICK_S, name="test-pending-client")
    try:
        assert not client.pending()  # no bound socket: nothing can wait there
        assert not server.pending()
        client.send(server.endpoint, b"first")
        assert first_in.wait(10)
        client.send(server.endpoint, b"second")
        assert _wait_for(server.pending, 10), "the unread message was not seen"
        assert server.pending()  # asking again changes nothing
        release.set()
        assert _wait_for(lambda: got == [b"first", b"second"], 10), got
        assert not server.pending()
    finally:
        release.set()
        client.close()
        server.close()
