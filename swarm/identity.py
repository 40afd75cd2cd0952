"""A peer's key: one RSA key is both its libp2p identity (peer id) and its record signature.

hivemind writes libp2p identities as a protobuf ``PrivateKey`` holding an RSA key (DER). We
load that same key into hivemind's ``RSASignatureValidator``, so a record signed by a peer
is tied to its peer id: readers derive the peer id from the record's public key and drop a
heartbeat that claims another id (see :func:`peer_id_of`). The run owner's key file (the
``--identity`` of ``workbench start``) is what signs the run manifest and steering changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from swarm.errors import SwarmError, folder_problem


def create_identity(path: str | Path) -> Path:
    """Write a new key to ``path`` (mode 0400), creating parent folders (see :func:`make_identity`)."""
    make_identity(path)
    return Path(path).expanduser()


def make_identity(path: str | Path) -> bool:
    """Write a new key to ``path`` (mode 0400), creating parent folders; False when another
    process created it first (its key is then this peer's: not a fresh one).

    hivemind writes the file under the user's umask and chmods it afterwards: another user
    could open it in between (5 of 6 tries in /tmp) and read the key. So the key is written
    into a file made 0600 first, under a temporary name beside ``path``, then linked to it: all or nothing,
    and only if nobody made ``path`` meanwhile (two peers given one --identity both took their
    key for fresh, and one signed with another key than its daemon loaded)."""
    from hivemind.p2p import P2P

    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a part of the path is a file: "[Errno 17] File exists" said nothing
        raise SwarmError(
            f"cannot make the folder of the key file {path} ({folder_problem(error, path.parent)}): "
            "give --identity a path in a folder this user can create and write to"
        ) from None
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:  # made 0600 first: hivemind's open(..., "wb") then keeps that mode
        os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        P2P.generate_identity(str(temporary))
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise SwarmError(f"cannot write the key file {path}: {error.strerror or error}") from None
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: an exclusive create
        return _create_exclusively(path, temporary.read_bytes())
    finally:
        temporary.unlink(missing_ok=True)


def _create_exclusively(path: Path, key: bytes) -> bool:
    try:
        handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(handle, "wb") as file:
        file.write(key)
    os.chmod(path, 0o400)
    return True


def ephemeral_identity() -> Path:
    """A fresh key in a folder of its own (0700) under the temp dir, for a peer that keeps no
    identity across restarts: a name freed in /tmp itself could be taken by another user while
    the key was made, and the peer would have run on that user's key."""
    folder = Path(tempfile.mkdtemp(prefix="workbench-identity-"))
    path = folder / "identity.key"
    if not make_identity(path):  # nobody else can write in a 0700 folder of this user's
        raise SwarmError(f"{path} appeared while this peer made its key; start it again")
    return path


def remove_ephemeral(path: Path) -> None:
    """Remove a key :func:`ephemeral_identity` made, and its folder."""
    path.unlink(missing_ok=True)
    if path.parent.name.startswith("workbench-identity-"):
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def load_private_key(path: str | Path):  # -> hivemind.utils.crypto.RSAPrivateKey
    """The RSA key in a libp2p identity file, with an error that says what to do if it is bad."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SwarmError(f"cannot read the key file {path}: {error.strerror or error}") from None
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        der = serialization.load_der_private_key(proto.data, password=None)
        if not isinstance(der, rsa.RSAPrivateKey):  # (an EC key marked RSA failed at its first signature)
            raise ValueError("not an RSA key")
    except Exception as error:
        raise SwarmError(
            f"{path} is not a workbench/hivemind key file ({type(error).__name__}): point --identity (or "
            "steer's --key) at the identity.key file a peer created; --identity may also name a path that "
            "does not exist yet, to create a new key"
        ) from None
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = der  # hivemind's class has no constructor from existing key material
    return key


def public_key_text(private_key) -> str:
    """The OpenSSH form ("ssh-rsa AAAA...") that record subkeys carry."""
    return private_key.get_public_key().to_bytes().decode()


def peer_id_of(public_key: bytes | str) -> str:
    """The libp2p peer id (base58) of an OpenSSH RSA public key; raises ValueError if malformed."""
    import multihash
    from cryptography.hazmat.primitives import serialization
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    if isinstance(public_key, str):
        public_key = public_key.encode()
    key = serialization.load_ssh_public_key(public_key)
    der = key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), "sha2-256")).to_base58()


def key_hash(public_key: bytes | str) -> str:
    """A short, stable name for a public key (what `--owner` takes): 16 hex digits."""
    if isinstance(public_key, str):
        public_key = public_key.encode()
    return hashlib.sha256(public_key.strip()).hexdigest()[:16]
