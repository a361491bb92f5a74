"""The shared shape's replicas intercept with ONE CA, from a read-only directory (the Secret
``egresswall-ca`` in compose/k8s/shared/proxy.yaml), and never make one of their own.

Two real ``egresswall run`` processes — two replicas — get the same ``--confdir``, made read-only and
holding exactly the Secret's three files. Each presents, for an intercepted host, a leaf certificate that
verifies against that CA's certificate (what a browser pod trusts, from the same Secret), and the
directory is unchanged afterwards. The negative control: a replica with an empty confdir of its own makes
a CA that the shared certificate does not verify.
"""

from __future__ import annotations

import os
import shutil
import ssl
import stat
from pathlib import Path

import pytest

SECRET_FILES = ("mitmproxy-ca.pem", "mitmproxy-dhparam.pem", "mitmproxy-ca-cert.pem")  # the Secret's items


def make_secret_dir(where: Path) -> Path:
    """What the kubelet mounts from the Secret: the three files, read-only."""
    from mitmproxy.certs import CertStore

    made = where / "made"
    CertStore.from_store(made, "mitmproxy", 2048)
    secret = where / "egresswall-ca"
    secret.mkdir()
    for name in SECRET_FILES:
        shutil.copy(made / name, secret / name)
        os.chmod(secret / name, 0o444)
    os.chmod(secret, 0o555)
    return secret


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in directory.iterdir()}


def leaf_verifies(proxy, host: str, port: int, ca_cert: Path) -> bool:
    """CONNECT through ``proxy`` and shake hands for ``host``, trusting ``ca_cert`` only."""
    sock, status, _ = proxy.connect(f"{host}:{port}")
    assert status == 200
    context = ssl.create_default_context(cafile=str(ca_cert))
    try:
        with context.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLCertVerificationError:
        return False
    except (ssl.SSLError, OSError) as err:  # anything else is not the answer this test asks for
        raise AssertionError(f"TLS through the proxy failed: {err}") from err
    finally:
        sock.close()


def intercepting_policy(lab) -> str:
    return lab.policy_text("hosts:\n  allow:\n    - host: public.lab.example\n      intercept: true\n")


@pytest.mark.integration
def test_two_replicas_intercept_with_the_one_shared_ca_and_never_write_it(lab, start_proxy, tmp_path):
    secret = make_secret_dir(tmp_path)
    before = snapshot(secret)
    ca_cert = secret / "mitmproxy-ca-cert.pem"
    replicas = [start_proxy(intercepting_policy(lab), "--confdir", str(secret), name=f"policy-{n}.yaml")
                for n in range(2)]
    try:
        for replica in replicas:
            assert leaf_verifies(replica, "public.lab.example", lab.public_tls.port, ca_cert), replica.stderr
    finally:
        os.chmod(secret, 0o755)  # so pytest can remove it
    assert snapshot(secret) == before


@pytest.mark.integration
def test_a_replica_with_a_confdir_of_its_own_makes_another_ca(lab, start_proxy, tmp_path):
    secret = make_secret_dir(tmp_path)
    own = tmp_path / "own"
    own.mkdir()
    replica = start_proxy(intercepting_policy(lab), "--confdir", str(own))
    try:
        assert not leaf_verifies(replica, "public.lab.example", lab.public_tls.port, secret / "mitmproxy-ca-cert.pem")
        assert (own / "mitmproxy-ca.pem").exists()  # it made one
    finally:
        os.chmod(secret, 0o755)


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="runs the replica as another uid (setpriv), which needs root")
def test_a_replica_that_cannot_write_the_shared_confdir_starts(tmp_path):
    """As the manifest runs it: a uid that is not root and may only read the mounted Secret. The confdir check
    refused any directory its user cannot write ("cannot be used as mitmproxy's CA directory"), so the shared
    replicas could not start (root, as the other tests here run, may write anything); a directory that holds
    the CA already is only read by mitmproxy, and is accepted (review round 18)."""
    import subprocess
    import sys
    import tempfile
    import time

    from unprivileged import unprivileged_argv

    # pytest's own folders are root's alone (0700): the replica's files go where its uid can reach them.
    shared = Path(tempfile.mkdtemp(prefix="egresswall-shared-ca-"))
    shared.chmod(0o755)
    secret = make_secret_dir(shared)
    policy = shared / "policy.yaml"
    policy.write_text("version: 1\ndefault: deny\nresolver: {nameservers: ['127.0.0.1:9']}\n"
                      "hosts:\n  allow:\n    - {host: a.example, intercept: true}\n")  # so the CA is loaded
    policy.chmod(0o644)
    argv = unprivileged_argv([sys.executable, "-m", "proxy.cli", "run", "--policy", str(policy), "--confdir",
                              str(secret), "--listen", "127.0.0.1:0", "--no-admin", "--log", "/dev/null"],
                             uid=10001)
    process = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline, said = time.monotonic() + 30, ""
        while time.monotonic() < deadline and "proxy on" not in said and process.poll() is None:
            said += process.stdout.readline()
        assert "egresswall: proxy on 127.0.0.1:" in said, said
        assert "interception CA" in said and str(secret) in said, said
    finally:
        process.terminate()
        process.wait(10)
        os.chmod(secret, 0o755)
        shutil.rmtree(shared)
