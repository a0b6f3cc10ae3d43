"""Which ports the pool may hand to a replica."""
from __future__ import annotations

import socket

from proxy.lifecycle.kinds.ports import port_free


def _time_wait_port() -> int:
    """A port whose only socket is in TIME_WAIT: the side that closes first keeps it, as a
    replica's server does when it exits with a connection open."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()          # the server side closes first: its end goes to TIME_WAIT once the client closes
    client.recv(1)
    client.close()
    listener.close()
    return port


def test_a_port_with_only_time_wait_sockets_is_free() -> None:
    port = _time_wait_port()
    with socket.socket() as probe:
        # The situation the pool meets after an unload: a plain bind fails...
        try:
            probe.bind(("127.0.0.1", port))
            plain_bind_failed = False
        except OSError:
            plain_bind_failed = True
    assert plain_bind_failed
    assert port_free(port)   # ...but a server (which sets SO_REUSEADDR) can listen there


def test_a_port_someone_listens_on_is_busy() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        assert not port_free(listener.getsockname()[1])
