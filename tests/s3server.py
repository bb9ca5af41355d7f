"""A real S3-compatible server for the tests: moto in server mode (HTTP on localhost), reached
through pyarrow's own S3 client exactly as a bucket on AWS would be."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "airay-test", "AWS_SECRET_ACCESS_KEY": "airay-test"}


@contextmanager
def s3_server():
    """Yields a function bucket_uri(prefix) -> 's3://BUCKET/prefix?endpoint_override=...' of a
    fresh bucket. Credentials go into this process's environment, so Ray processes started
    meanwhile (raylets, workers) inherit them, as they would an instance profile's."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    bucket = f"airay-{uuid.uuid4().hex[:8]}"

    def bucket_uri(prefix: str) -> str:
        return (f"s3://{bucket}/{prefix}?endpoint_override=http://{host}:{port}&region=us-east-1"
                "&allow_bucket_creation=true")

    from airay.storage import Storage

    Storage(bucket_uri("x")).fs.create_dir(bucket)
    try:
        yield bucket_uri
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
