"""RSA signatures over the formula's events: the one place they are made and checked.

The beacon signs each event with the minion's key (``minion.pem``), the master each event of its
own with ``master.pem``; the master and the exporter check them with the sender's public key.
PKCS#1 v1.5 with SHA-224: what ``salt.crypt.verify_signature(..., algorithm=PKCS1v15_SHA224)``
checks on Salt 3006.9 and later, 3007 and 3008 alike. Keys are read through
``salt.crypt.get_rsa_key``, which all three lines have and which keeps a key loaded until its
file changes: ``salt.crypt.sign_message`` loads and checks it again for every message (95 ms
with a 2048-bit key, 450 ms with a 4096-bit one, on the test machine).
"""

import base64

import salt.crypt
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding

ALGORITHM = salt.crypt.PKCS1v15_SHA224


def private_key(path, passphrase=None):
    """The RSA key in the PEM file ``path``, kept loaded by Salt until the file changes."""
    return salt.crypt.get_rsa_key(path, passphrase)


def sign(path, message, passphrase=None):
    """The base64 signature over ``message`` (bytes) with the private key in ``path``."""
    signature = private_key(path, passphrase).sign(message, padding.PKCS1v15(), hashes.SHA224())
    return base64.b64encode(signature).decode()


def verifies(public_path, message, signature):
    """Whether ``signature`` (base64 text) over ``message`` verifies with the public key in
    ``public_path``. A signature that is not even base64 is a forgery like any other."""
    if not isinstance(signature, str) or not signature:
        return False
    try:
        return bool(
            salt.crypt.verify_signature(
                public_path, message, base64.b64decode(signature), algorithm=ALGORITHM
            )
        )
    except Exception:  # noqa: BLE001 - whatever fails to verify does not verify
        return False
