"""A real `qlite serve` app on 127.0.0.1 over a started engine, for the server's and the chat page's tests."""
import contextlib
import socket
import threading
import time

from qlite.serve.server import Limits, make_app, server_config

LIMITS = Limits(max_body_bytes=64 * 1024, timeout_s=2.0, max_connections=40)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(lm, engine, **options):
    """(port, engine) of a server on 127.0.0.1 over a started engine, until the block ends."""
    import uvicorn

    port = free_port()
    config = server_config(make_app(lm, engine, options.pop("names", "tiny"), LIMITS, **options), "127.0.0.1", port,
                           LIMITS)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield port, engine
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.stop()
