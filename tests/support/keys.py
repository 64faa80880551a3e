"""RSA key pairs as Salt keeps them (PEM files), made the same way on every Salt line: Salt's own
``gen_keys`` takes ``(keysize)`` and returns strings on 3008, ``(keydir, keyname, keysize)`` and
writes files on 3006 and 3007."""

import pathlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def keypair(bits=2048):
    """(private PEM, public PEM) as text, in the formats Salt writes."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    return private, public


def write_keypair(directory, name, bits=2048):
    """<directory>/<name>.pem (0400) and <name>.pub; returns their paths."""
    directory = pathlib.Path(directory)
    private, public = keypair(bits)
    pem, pub = directory / f"{name}.pem", directory / f"{name}.pub"
    pem.write_text(private)
    pem.chmod(0o400)
    pub.write_text(public)
    return pem, pub
