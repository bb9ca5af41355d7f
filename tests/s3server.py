"""A real S3-compatible server for the tests: moto in server mode (HTTP on localhost), reached
through pyarrow's own S3 client exactly as a bucket on AWS would be."""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable

from tests.conftest import patched_environ

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "airay-test", "AWS_SECRET_ACCESS_KEY": "airay-test"}
# A held request is answered after at most this long (then the next one is held): below the S3
# client's 3 s request timeout, so holding slows uploads down without failing them.
HOLD_PER_REQUEST_S = 1.0


def _holding(app, hold: Callable[[str], bool] | None, log: list | None, get_s: float):
    """WSGI middleware: a PUT whose path (/bucket/key) `hold` says to hold waits (a slow store); a
    GET is answered after `get_s` (a store's latency); every request goes into `log` as (method,
    path, Range header or None, requests in flight when it came, itself included)."""
    lock, in_flight = threading.Lock(), [0]

    def held(environ, start_response):
        with lock:
            in_flight[0] += 1
            if log is not None:
                log.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("HTTP_RANGE"), in_flight[0]))
        try:
            if hold is not None and environ["REQUEST_METHOD"] == "PUT":
                deadline = time.time() + HOLD_PER_REQUEST_S
                while time.time() < deadline and hold(environ["PATH_INFO"]):
                    time.sleep(0.05)
            if environ["REQUEST_METHOD"] == "GET":
                time.sleep(get_s)
            return app(environ, start_response)
        finally:
            with lock:
                in_flight[0] -= 1

    return held


@contextmanager
def s3_server(hold: Callable[[str], bool] | None = None, log: list | None = None, get_s: float = 0.0):
    """Yields a function bucket_uri(prefix) -> 's3://BUCKET/prefix?endpoint_override=...' of a
    fresh bucket. Credentials go into this process's environment, so Ray processes started
    meanwhile (raylets, workers) inherit them, as they would an instance profile's.
    `hold(path)`: whether to hold an object's PUT for now (asked again every 50 ms, at most
    HOLD_PER_REQUEST_S per request): a store as slow as a test needs. `log`: a list every request
    is appended to (see _holding); `get_s`: how long each GET takes at least."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:  # moto's own, with the app wrapped
            app = DomainDispatcherApplication(create_backend_app)
            self._server = make_server(self._ip_address, self._port, _holding(app, hold, log, get_s), True,
                                       request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    with patched_environ(CREDENTIALS):
        server = Server(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        bucket = f"airay-{uuid.uuid4().hex[:8]}"

        def bucket_uri(prefix: str) -> str:
            return (f"s3://{bucket}/{prefix}?endpoint_override=http://{host}:{port}&region=us-east-1"
                    "&allow_bucket_creation=true")

        from airay.checkpoint.storage import Storage

        Storage(bucket_uri("x")).fs.create_dir(bucket)
        try:
            yield bucket_uri
        finally:
            server.stop()
