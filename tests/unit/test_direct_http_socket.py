"""The ingress's shared listening socket (cluster/direct_http.py): the ingress replicas of a node
share the port, and a port held by anything else is an error naming the config field."""

import socket

import pytest

from kvmesh.cluster.direct_http import shared_socket
from kvmesh.cluster.local import free_port


def test_replicas_share_the_port_and_a_foreign_holder_is_a_clear_error():
    port = free_port()
    first, second = shared_socket("127.0.0.1", port), shared_socket("127.0.0.1", port)
    first.close()
    second.close()
    with socket.socket() as other:  # a process that did not ask to share the port
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(ValueError, match=r"server\.direct_http_port: cannot listen on 127\.0\.0\.1:\d+"):
            shared_socket("127.0.0.1", port)
