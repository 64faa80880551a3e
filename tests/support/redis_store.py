"""A real redis-server for the tests of the shared triage store: loopback only, a random password,
nothing written to disk, stopped (and its files removed) on exit."""

import contextlib
import secrets
import shutil
import subprocess
import time

import redis

from tests.support.master import free_port


@contextlib.contextmanager
def redis_server(workdir):
    """Yields the server's URL (redis://:<password>@127.0.0.1:<port>/0) once it answers."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run tools/install-deps.sh (Debian package redis-server)"
    password, port = secrets.token_hex(16), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "redis.conf"  # the password in a 0600 file, never in argv
    config.touch(mode=0o600)
    config.write_text(
        f'port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave ""\nappendonly no\n'
        f"dir {workdir}\nlogfile {workdir / 'redis.log'}\n"
    )
    server = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, f"redis-server exited: read {workdir / 'redis.log'}"
                assert time.monotonic() < deadline, (
                    f"redis-server did not answer in 30 s: {workdir / 'redis.log'}"
                )
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
