"""What a network peer can do to the Mooncake transfer engine itself (docs/security.md).

The installed engine (mooncake-transfer-engine 0.3.13.post1, TCP) is started by kvbridge's
``MooncakeTransport`` in a separate process; this process then speaks the engine's TCP data
protocol directly (a 24-byte header: u64 length, u64 address, u8 opcode 0 read / 1 write,
padded; see SessionHeader in Mooncake's tcp_transport) with no handshake and no credential.
These tests pin the facts the security doc states, so an engine upgrade that changes them
fails here and the doc gets revisited.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import time

HDR = "<QQB7x"


def _victim(conn):
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    import ctypes

    import psutil
    import torch

    from kvbridge.common.transport import MooncakeTransport

    t = MooncakeTransport("127.0.0.1")
    reg = torch.zeros(4096, dtype=torch.uint8)
    reg[:16] = torch.frombuffer(bytearray(b"KV-OF-A-PROMPT!!"), dtype=torch.uint8)
    t.register_tensor(reg)
    other = ctypes.create_string_buffer(b"NOT-REGISTERED!!", 64)
    listening = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
                        if c.status == "LISTEN"})
    conn.send((t.session_id, reg.data_ptr(), ctypes.addressof(other), listening))
    while conn.recv() == "read":
        conn.send((bytes(reg[:16].numpy()), bytes(other.raw[:16])))


def _read(sock, n):
    out = b""
    sock.settimeout(3)
    try:
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    return out


def _victim_reads(conn, done, timeout_s: float = 10.0):
    """The victim's two buffers, read until ``done(registered, unregistered)`` (deadline)."""
    end = time.monotonic() + timeout_s
    while True:
        conn.send("read")
        assert conn.poll(10)
        got = conn.recv()
        if done(*got):
            return got
        assert time.monotonic() < end, f"the victim's memory never changed: {got}"
        time.sleep(0.01)


def test_any_tcp_client_reads_and_writes_registered_memory_only():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_victim, args=(child,), daemon=True)
    proc.start()
    try:
        assert conn.poll(90)
        session, reg, other, listening = conn.recv()
        rpc = int(session.rsplit(":", 1)[1])
        data_ports = [p for ip, p in listening if p != rpc]
        # both the handshake (RPC) port and the data port listen on every interface
        assert (("0.0.0.0", rpc) in listening or ("::", rpc) in listening), listening
        assert data_ports and all(ip in ("0.0.0.0", "::") for ip, p in listening if p in data_ports), listening
        port = data_ports[0]
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(struct.pack(HDR, 16, reg, 0))  # read registered memory: no credential asked
            assert _read(s, 16) == b"KV-OF-A-PROMPT!!"
            s.sendall(struct.pack(HDR, 4, reg + 3, 1) + b"XXXX")  # write it
            mine, _ = _victim_reads(conn, lambda m, t: m != b"KV-OF-A-PROMPT!!")
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(struct.pack(HDR, 16, other, 0))  # unregistered memory: refused, connection closed
            assert _read(s, 16) == b""
        with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
            s.sendall(struct.pack(HDR, 4, other, 1) + b"YYYY")
            assert _read(s, 1) == b""  # the engine refused the write: it closed the connection
        mine, theirs = _victim_reads(conn, lambda m, t: True)
        assert mine == b"KV-XXXX-PROMPT!!"  # the registered buffer was overwritten by a stranger
        assert theirs == b"NOT-REGISTERED!!"  # memory outside registered buffers was not
    finally:
        conn.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _idle_engine(conn, env):
    os.environ.update(env)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    import psutil

    from kvbridge.common.transport import MooncakeTransport

    t = MooncakeTransport("127.0.0.1")
    conn.send((t.session_id, sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
                                     if c.status == "LISTEN"})))
    conn.recv()


def test_handshake_port_dies_on_one_malformed_message_and_ports_can_be_pinned():
    """One length-prefixed JSON value that is not an object, sent to the P2P handshake port,
    aborts the whole process (an uncaught Json::LogicError in the engine); and
    MC_MIN_RPC_PORT / MC_MAX_RPC_PORT pin both listening ports (for firewall rules), while
    MC_TCP_BIND_ADDRESS does not narrow the wildcard listen addresses."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    env = {"MC_MIN_RPC_PORT": "16300", "MC_MAX_RPC_PORT": "16340", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    proc = ctx.Process(target=_idle_engine, args=(child, env), daemon=True)
    proc.start()
    try:
        assert conn.poll(90)
        session, listening = conn.recv()
        assert all(16300 <= p <= 16340 for _, p in listening), listening
        assert all(ip in ("0.0.0.0", "::") for ip, _ in listening), listening
        rpc = int(session.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", rpc), timeout=3) as s:
            s.sendall(struct.pack("<Q", 2) + b"[]")
            proc.join(10)
        assert not proc.is_alive() and proc.exitcode == -6  # SIGABRT: the prefill/decode engine would be gone
    finally:
        if proc.is_alive():
            conn.send("stop")
            proc.join(10)
            proc.kill()
