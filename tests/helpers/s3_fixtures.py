"""A real S3 server for the tests (moto's server mode on 127.0.0.1) and a proxy that breaks it.

``S3Server`` runs ``moto.server.ThreadedMotoServer``; the jobs talk to it through
s3fs exactly as a user's job does, by ``AWS_ENDPOINT_URL``. ``Proxy`` sits in front
of it on another port and, when told, slows what clients send (an upload), answers
``503 Slow Down`` without forwarding, or cuts connections after a few bytes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's S3 server on 127.0.0.1, on a port the OS chose."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.port = int(port)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The variables a job needs to reach the server (or ``endpoint``, a proxy)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        import boto3

        name = f"run-{secrets.token_hex(4)}"
        client = boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials())
        client.create_bucket(Bucket=name)
        return name

    def fs(self) -> Any:
        """An s3fs file system on the server, for the tests' own looks."""
        import s3fs

        return s3fs.S3FileSystem(
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
            use_listings_cache=False,
        )

    def stop(self) -> None:
        self._server.stop()


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


class Proxy:
    """A TCP proxy to ``port`` on 127.0.0.1 that can slow, refuse (503) or cut connections.

    Attributes:
        upload_bytes_per_s: what a client sends is passed on at this rate (None: at once).
        fail_next: the next this many requests are answered ``503 Slow Down``.
        cut_next: the next this many connections are closed after the request's first bytes.
        requests: how many connections came.
    """

    def __init__(self, port: int) -> None:
        self.target = port
        self.upload_bytes_per_s: float | None = None
        self.fail_next = 0
        self.cut_next = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name="s3-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self.requests += 1
            fail, cut = self.fail_next > 0, self.fail_next == 0 and self.cut_next > 0
            self.fail_next -= fail
            self.cut_next -= cut
        if fail or cut:
            try:
                client.recv(1024)
                if fail:
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: 0\r\nConnection: close\r\n\r\n"
                    )
            except OSError:
                pass
            client.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pipe, args=(upstream, client, None), daemon=True).start()
        self._pipe(client, upstream, self.upload_bytes_per_s)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, rate: float | None) -> None:
        try:
            while data := source.recv(65536 if rate is None else 16384):
                sink.sendall(data)
                if rate is not None:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """These environment variables for the block (the jobs started in it inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
