"""Connection caps for connections mitmproxy accepted itself (stock mitmdump, where no front admits).

Under ``egresswall run`` (``fronted``) every connection mitmproxy sees was admitted by the front, which
hands the admission along with the socket and takes it back when mitmproxy has finished with it
(proxy/runner.py ``_handoff``): nothing is counted here, and nothing is matched up by peer address.
"""

from __future__ import annotations

from mitmproxy import connection

from ..gate import Gate
from ..peers import peer_of
from .connections import ConnectionTable


class AdmissionAddon:
    def __init__(self, gate: Gate, table: ConnectionTable, fronted: bool) -> None:
        self.gate, self.table, self.fronted = gate, table, fronted

    def client_connected(self, client: connection.Client) -> None:
        if self.fronted:
            return  # admitted by the front, and given back by it
        key = peer_of(client.peername)
        cap = self.gate.admit(key)
        if cap is not None:
            # No request has been read, so there is no host to name; mitmproxy closes the connection.
            self.gate.refuse_admission(key, cap)
            client.error = cap.reason
            return
        self.table.admitted[client.id] = key

    def client_disconnected(self, client: connection.Client) -> None:
        key = self.table.admitted.pop(client.id, None)
        if key is not None:
            self.gate.release(key)
        failed = self.table.failed_inside.get(client.id)
        closed = "the client connection closed" + (f" after a request inside the tunnel failed: {failed}"
                                                   if failed else "")
        # Whatever ended this connection, its tunnels end with it: each gets its closing line.
        for tunnel in self.table.forget_client(client.id):
            if tunnel.first_byte_at is None:  # mitmproxy asks for a tunnel's layer at its first byte: none came
                self.gate.tunnel_cut_short(tunnel, 0)
            else:
                self.gate.tunnel_closed(tunnel, 0, 0, closed)
