"""Free loopback ports for the services the tests start."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now.

    The port is released before it is returned, so another process could take it in between;
    starters that bind it should fail clearly rather than retry blindly.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
