"""TLS certificates for a SuperLink and authentication keys for SuperNodes.

``make_ca_and_server_cert`` writes a private CA (``ca.crt``, ``ca.key``) and a server certificate
signed by it (``server.pem``, ``server.key``) whose SANs cover the addresses clients dial
(default: ``IP:127.0.0.1``, ``DNS:localhost``, ``DNS:superlink``). ``make_node_key`` writes an
ECDSA P-384 key pair in OpenSSH format (``<name>`` and ``<name>.pub``), what ``ssh-keygen -t
ecdsa -b 384 -N ""`` makes and what ``flwr supernode register`` / ``--auth-supernode-private-key``
read. Existing files are kept, so re-running is harmless (``--force`` replaces them). Every file
is written atomically (a fresh ``O_EXCL`` temporary file, then a rename); private keys are mode
0600 from the moment they exist, in a folder created 0700.

``python -m fedcybgd.deploy.certs DIR [--san DNS:host|IP:addr ...] [--nodes N]`` does both (the
docker-compose ``certs`` service runs it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SANS = ("IP:127.0.0.1", "DNS:localhost", "DNS:superlink")
_VALID_DAYS = 365


@dataclass(frozen=True)
class CertFiles:
    """Where the CA and the server certificate are."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """A SuperNode's key pair (OpenSSH format)."""

    private: Path
    public: Path


PRIVATE_MODE = 0o600  # private keys: the owner only, from the moment the file exists
PUBLIC_MODE = 0o644  # certificates and public keys


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``path`` atomically with its final permissions from the start.

    The bytes go to a new temporary file beside ``path``, created with ``O_CREAT | O_EXCL``
    (never an existing file, nor a planted symlink: ``O_NOFOLLOW``) and mode 0600 for private
    keys (``fchmod`` pins the mode whatever the umask), fsynced, then renamed over ``path``; the
    folder is fsynced too. A key is thus never readable by others, not even for an instant, and a
    crash leaves either the old file or the new one, never half a key.
    """
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = PRIVATE_MODE if private else PUBLIC_MODE
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(
        os, "O_CLOEXEC", 0)
    tmp = folder / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, flags, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _keep_private(path: Path) -> None:
    """An existing private key readable by others (written by an older version with the umask)
    is tightened to 0600, and the change is reported."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, PRIVATE_MODE)
        print(f"{path}: was mode {mode:o}, now {PRIVATE_MODE:o} (a private key)",
              file=sys.stderr)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(entry: str) -> x509.GeneralName:
    kind, _, value = entry.partition(":")
    if kind.upper() == "IP":
        return x509.IPAddress(ipaddress.ip_address(value))
    if kind.upper() == "DNS":
        return x509.DNSName(value)
    raise ValueError(f"a SAN is DNS:<name> or IP:<address>, got {entry!r}")


def make_ca_and_server_cert(
    folder: Path, sans: tuple[str, ...] = DEFAULT_SANS, force: bool = False
) -> CertFiles:
    """Write (or keep) ``ca.crt``/``ca.key`` and ``server.pem``/``server.key`` in ``folder``."""
    files = CertFiles(folder / "ca.crt", folder / "ca.key", folder / "server.pem",
                      folder / "server.key")
    if not force and all(p.exists() for p in (files.ca_cert, files.server_cert,
                                              files.server_key)):
        for key in (files.ca_key, files.server_key):
            if key.exists():
                _keep_private(key)
        return files
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=_VALID_DAYS)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedcybgd test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superlink")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(s) for s in sans]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(files.ca_key, _pem_key(ca_key), private=True)
    _write(files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(files.server_key, _pem_key(server_key), private=True)
    _write(files.server_cert, server_cert.public_bytes(serialization.Encoding.PEM))
    return files


def make_node_key(folder: Path, name: str, force: bool = False) -> NodeKey:
    """Write (or keep) an ECDSA P-384 OpenSSH key pair ``folder/name`` + ``folder/name.pub``."""
    key = NodeKey(folder / name, folder / f"{name}.pub")
    if not force and key.private.exists() and key.public.exists():
        _keep_private(key.private)
        return key
    private = ec.generate_private_key(ec.SECP384R1())
    _write(key.private, private.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.OpenSSH,
                                              serialization.NoEncryption()), private=True)
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                               serialization.PublicFormat.OpenSSH)
    _write(key.public, public + f" {name}\n".encode())
    return key


def main(argv: list[str] | None = None) -> int:
    """Write the CA, the server certificate and ``--nodes`` SuperNode keys into a folder."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--san", action="append", default=None,
                        help=f"subject alternative name (repeatable; default {DEFAULT_SANS})")
    parser.add_argument("--nodes", type=int, default=0,
                        help="SuperNode keys supernode-1 .. supernode-N")
    parser.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    files = make_ca_and_server_cert(args.folder, tuple(args.san or DEFAULT_SANS), args.force)
    print(f"CA: {files.ca_cert}\nserver certificate: {files.server_cert} (key {files.server_key})")
    for i in range(1, args.nodes + 1):
        key = make_node_key(args.folder, f"supernode-{i}", args.force)
        print(f"SuperNode key: {key.private} (register {key.public})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
