"""The lab CA and the public lab host's certificate (signed by it), and the CA's SPKI hash.

Chromium is told to trust the CA with ``--ignore-certificate-errors-spki-list=<hash>``: the base64
SHA-256 of the CA's SubjectPublicKeyInfo. The server sends leaf + CA, so the CA is in the chain.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class LabCerts:
    ca_file: Path  # the CA certificate (PEM): for clients that verify
    chain_file: Path  # leaf + CA (PEM): what the server sends
    key_file: Path
    ca_spki_sha256: str  # base64 SHA-256 of the CA's SubjectPublicKeyInfo


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "egresswall containment lab"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_lab_certs(folder: Path, names: list[str], addresses: list[str]) -> LabCerts:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("egresswall lab CA")).issuer_name(_name("egresswall lab CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    leaf = (
        x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    ca_file, chain_file, key_file = folder / "lab-ca.pem", folder / "public-chain.pem", folder / "public-key.pem"
    ca_file.write_bytes(ca.public_bytes(pem))
    chain_file.write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    spki = ca.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return LabCerts(ca_file, chain_file, key_file, base64.b64encode(hashlib.sha256(spki).digest()).decode())
