"""/readyz asks the session store PING: only PONG is ready (proxy/sessions/redis_store.py RedisStore.ping). A
loopback server that answers every command with +OK (no Redis, or not one that works) is not ready (review round
23: any answer at all counted as ready)."""

from __future__ import annotations

import asyncio
import socket
import threading

from proxy.sessions.redis_store import RedisStore


class AnswersOk:
    """A loopback TCP server that answers each command it reads with +OK (RESP), HELLO with an error."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                if b"HELLO" in data.upper():  # an old server's answer: the client speaks RESP2 then
                    conn.sendall(b"-ERR unknown command 'HELLO'\r\n")
                elif b"\r\n" in data:
                    conn.sendall(b"+OK\r\n" * max(1, data.count(b"*")))


def test_a_store_that_does_not_answer_pong_is_not_ready():
    server = AnswersOk()

    async def ask() -> bool:
        store = RedisStore(f"redis://127.0.0.1:{server.port}/0")
        try:
            return await store.ping()
        finally:
            await store.close()

    try:
        assert asyncio.run(ask()) is False
    finally:
        server.sock.close()
