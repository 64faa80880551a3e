"""A real redis-server for the tests of the shared triage store: loopback only, a random password,
nothing written to disk, stopped (and its files removed) on exit. Optionally with ACL users of its
own and over TLS only (a throwaway CA and server certificate made with openssl)."""

import contextlib
import secrets
import shutil
import subprocess
import time
import urllib.parse

import redis

from tests.support.master import free_port

# The narrowest ACL the triage store runs with (README, "More than one master"): its commands, on
# keys under a prefix given before it (``~hana_storage:*``, or one cluster's ``~hana_storage:<id>:*``).
STORE_ACL = (
    "resetchannels -@all +get +set +time +watch +unwatch +multi +exec +discard +hincrby +hgetall +hset"
    " +hdel +hmget +zadd +zrem +zrangebyscore +lpush +ltrim +lrange"
)


@contextlib.contextmanager
def redis_server(workdir, users=None, tls=False):
    """Yields the server's URL for its default user (``redis://:<password>@127.0.0.1:<port>/0``)
    once it answers. ``users``: {name: (password, ACL rules)}, e.g. ``("pw", "~hana_storage:*
    +@all")``. With ``tls`` the server listens for TLS only and the URL is ``rediss://...
    ?ssl_ca_certs=<the CA's certificate>``: the client verifies the server's certificate."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run tools/install-deps.sh (Debian package redis-server)"
    password, port = secrets.token_hex(16), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "redis.conf"  # the passwords in a 0600 file, never in argv
    config.touch(mode=0o600)
    lines = [f'bind 127.0.0.1\nrequirepass {password}\nsave ""\nappendonly no\ndir {workdir}']
    lines.append(f"logfile {workdir / 'redis.log'}")
    lines += [f"user {name} on >{secret} {rules}" for name, (secret, rules) in (users or {}).items()]
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    if tls:
        ca, cert, key = certificates(workdir)
        lines.append(f"port 0\ntls-port {port}\ntls-cert-file {cert}\ntls-key-file {key}")
        lines.append(f"tls-ca-cert-file {ca}\ntls-auth-clients no")
        url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={urllib.parse.quote(str(ca))}"
    else:
        lines.append(f"port {port}")
    config.write_text("\n".join(lines) + "\n")
    server = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
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


def as_user(url, user, password):
    """``url`` with another user's credentials."""
    parts = urllib.parse.urlsplit(url)
    netloc = f"{urllib.parse.quote(user)}:{urllib.parse.quote(password)}@{parts.hostname}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def certificates(workdir):
    """(CA certificate, server certificate, server key) made with openssl in ``workdir``: a CA of a
    day, and a certificate it signed for 127.0.0.1 (subjectAltName IP)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is not installed (Debian package openssl)"
    ca, ca_key = workdir / "ca.crt", workdir / "ca.key"
    cert, key, request = workdir / "server.crt", workdir / "server.key", workdir / "server.csr"
    extensions = workdir / "server.ext"
    extensions.write_text("subjectAltName = IP:127.0.0.1\n")
    for args in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1"]
        + ["-subj", "/CN=hana-storage test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert]
        + ["-days", "1", "-extfile", extensions],
    ):
        subprocess.run([openssl, *map(str, args)], check=True, capture_output=True)
    return ca, cert, key
