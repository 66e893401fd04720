"""The etcd store on a secured etcd, as production sites run it: a real etcd member with
TLS (client certificates required) and etcd's authentication on, its certificates made
here with openssl. The store and the rendezvous work through it; a wrong password, a
wrong client certificate, an untrusted member and a certificate with a Common Name each
give one clear error at once; an expired token and a changed auth store are renewals."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_etcd_store import IN_CI, _free_ports
from torch.distributed.elastic.rendezvous import RendezvousParameters

from sfharness import join_rendezvous
from steadfast.rendezvous.create import create_handler
from steadfast.rendezvous.etcd import EtcdStoreError, EtcdV3Store
from steadfast.rendezvous.etcd_access import PASSWORD_ENV, EtcdAccess

pytestmark = pytest.mark.timeout(120)

PASSWORD = "s3cret-pw"
#: the member's simple-token TTL (--auth-token-ttl): short, so that a test sees expiry
TOKEN_TTL = 2


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


def _signed(d: Path, name: str, ca: str, subject: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.csr", "-subj", subject, cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
             f"{name}.ext", cwd=d)  # fmt: skip


class SecuredEtcd:
    """One etcd member on https, client certificates required, auth on (user ``root``),
    simple tokens that expire after TOKEN_TTL s unused."""

    def __init__(self, d: Path, data: Path) -> None:
        self.d = d  # the certificates
        self.auth = False
        client_port, peer_port = _free_ports(2)
        self.endpoint = f"127.0.0.1:{client_port}"
        url = f"https://{self.endpoint}"
        self.log = data / "etcd.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "s", "--data-dir", str(data / "data"),
                 "--listen-client-urls", url, "--advertise-client-urls", url,
                 "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                 "--initial-cluster", f"s=http://127.0.0.1:{peer_port}",
                 "--cert-file", str(d / "server.pem"), "--key-file", str(d / "server.key"),
                 "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth",
                 "--auth-token", "simple", "--auth-token-ttl", str(TOKEN_TTL)],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while self.ctl("endpoint", "health", check=False).returncode != 0:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log.read_text(errors="replace").splitlines()[-5:]
                    raise AssertionError("the secured etcd did not start:\n" + "\n".join(tail))
                time.sleep(0.2)
            self.ctl("user", "add", f"root:{PASSWORD}")
            self.ctl("user", "grant-role", "root", "root")
            self.ctl("auth", "enable")
            self.auth = True
        except BaseException:
            self.close()
            raise

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """etcdctl on the member (over gRPC, as root once auth is on)."""
        d = self.d
        user = ["--user", f"root:{PASSWORD}"] if self.auth else []
        return subprocess.run(
            ["etcdctl", "--endpoints", f"https://{self.endpoint}", "--cacert", str(d / "ca.pem"),
             "--cert", str(d / "client-cn.pem"), "--key", str(d / "client-cn.key"), *user,
             *args],
            capture_output=True, text=True, timeout=30, check=check,
        )  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def conf(self, **changes: str | None) -> dict[str, str]:
        """``--rdzv-conf`` of a job on this etcd (``changes``: one option swapped)."""
        d = self.d
        conf = {"cacert": str(d / "ca.pem"), "cert": str(d / "client.pem"),
                "key": str(d / "client.key"), "user": "root",
                "password_file": str(d / "password")}  # fmt: skip
        conf.update(changes)  # type: ignore[arg-type]
        return {k: v for k, v in conf.items() if v is not None}

    def store(self, **changes: str | None) -> EtcdV3Store:
        conf = self.conf(**changes)
        return EtcdV3Store(
            [f"https://{self.endpoint}"], prefix="/tls", timeout=datetime.timedelta(seconds=10),
            retry_window=5.0, access=EtcdAccess.from_conf(conf.get, environ={}),
        )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, the member's certificate, the job's client certificate (no CN), one with a
    CN, one of another CA, and the user's password file."""
    for tool in ("etcd", "etcdctl", "openssl"):
        if shutil.which(tool) is None:
            if IN_CI:
                pytest.fail(f"{tool} is not installed; CI must run the secured etcd tests")
            pytest.skip(f"{tool} is not installed (`make test` installs it)")
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    server = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    client = "extendedKeyUsage=clientAuth\n"
    _signed(d, "server", "ca", "/CN=etcd-member", server)
    # no CN: etcd's JSON gateway refuses a client certificate with one while auth is on
    _signed(d, "client", "ca", "/O=steadfast-job", client)
    _signed(d, "client-cn", "ca", "/CN=root", client)
    _signed(d, "foreign", "other-ca", "/O=another-site", client)
    (d / "password").write_text(PASSWORD + "\n")
    return d


@pytest.fixture
def etcd(certs: Path, tmp_path: Path) -> Iterator[SecuredEtcd]:
    member = SecuredEtcd(certs, tmp_path)
    yield member
    member.close()


def test_the_store_works_over_tls_with_a_user(etcd: SecuredEtcd) -> None:
    store = etcd.store()
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.compare_set("a", "1", "2") == b"2"
    writer = etcd.store()
    timer = threading.Timer(0.3, lambda: writer.set("later", b"v"))
    timer.start()
    assert store.get("later") == b"v"  # a watch, over TLS with the token
    timer.join()
    writer.close()
    # torch's etcd rendezvous names for the TLS files work the same
    aliases = etcd.conf(cacert=None, cert=None, key=None)
    aliases.update(ca_cert=etcd.conf()["cacert"], ssl_cert=etcd.conf()["cert"],
                   ssl_cert_key=etcd.conf()["key"])  # fmt: skip
    other = EtcdV3Store([f"https://{etcd.endpoint}"], prefix="/tls",
                        access=EtcdAccess.from_conf(aliases.get, environ={}))  # fmt: skip
    assert other.get("n") == b"2"
    store.close()
    other.close()


def test_the_rendezvous_forms_on_the_secured_etcd_from_rdzv_conf(
    etcd: SecuredEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three nodes' handlers made as `steadfast launch` makes them: --rdzv-conf holds the
    files and the user, the password comes from the environment."""
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    conf = etcd.conf(password_file=None)
    handlers = []
    for i in range(3):
        params = RendezvousParameters(
            "steadfast", etcd.endpoint, "tls-job", 3, 3, local_addr="127.0.0.1",
            store_type="etcd", join_timeout="60", **conf,
        )  # fmt: skip
        handler = create_handler(params)
        handler.node = f"n{i}"
        handlers.append(handler)
    formed = join_rendezvous(*handlers)
    assert sorted(v[0] for v in formed.values()) == [0, 1, 2], formed
    for h in handlers:
        h.store.close()


def _refused(etcd: SecuredEtcd, match: str, **changes: str | None) -> None:
    store = etcd.store(**changes)
    began = time.monotonic()
    with pytest.raises(EtcdStoreError, match=match):
        store.set("x", b"1")
    assert time.monotonic() - began < 4.0  # at once, not after the retry window (5 s)
    store.close()


def test_a_wrong_password_is_one_clear_error(etcd: SecuredEtcd, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it\n")
    _refused(etcd, "user 'root' or its password is wrong", password_file=str(wrong))


def test_a_client_certificate_of_another_ca_is_one_clear_error(etcd: SecuredEtcd) -> None:
    d = etcd.d
    _refused(etcd, "TLS handshake failed.*cert=.*foreign.pem",
             cert=str(d / "foreign.pem"), key=str(d / "foreign.key"))  # fmt: skip


def test_a_member_the_ca_does_not_vouch_for_is_one_clear_error(etcd: SecuredEtcd) -> None:
    _refused(etcd, "not trusted by cacert=.*other-ca.pem", cacert=str(etcd.d / "other-ca.pem"))


def test_a_certificate_with_a_common_name_is_explained(etcd: SecuredEtcd) -> None:
    d = etcd.d
    _refused(etcd, "has a Common Name.*no login by certificate",
             cert=str(d / "client-cn.pem"), key=str(d / "client-cn.key"))  # fmt: skip


def test_no_user_on_an_etcd_with_auth_is_one_clear_error(etcd: SecuredEtcd) -> None:
    _refused(etcd, "no user= \\(auth is on\\)", user=None, password_file=None)


def test_an_expired_token_and_a_changed_auth_store_are_renewed(etcd: SecuredEtcd) -> None:
    store = etcd.store()
    store.set("t", b"1")
    first = dict(store._tokens)
    time.sleep(TOKEN_TTL + 1.5)  # an idle launcher: its token expired meanwhile
    assert store.add("t", 1) == 2
    second = dict(store._tokens)
    assert second and second != first
    # the auth store changes (another user): a token issued before is refused as old
    etcd.ctl("user", "add", f"reader{os.getpid()}:pw")
    assert store.add("t", 1) == 3
    store.close()


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"cert": "{d}/client.pem"}, "needs its key"),
        ({"user": "root"}, "no password"),
        ({"password_file": "{d}/password"}, "without user="),
        ({"user": "root", "password": "x", "password_file": "{d}/password"}, "choose one"),
        ({"cacert": "{d}/absent.pem"}, "cacert: .* is not a readable file"),
        ({"cacert": "{d}/ca.pem", "ca_cert": "{d}/ca.pem"}, "name the same etcd option"),
    ],
)
def test_bad_options_name_the_option(tmp_path: Path, conf: dict[str, str], match: str) -> None:
    (tmp_path / "client.pem").write_text("")
    (tmp_path / "password").write_text("pw")
    (tmp_path / "ca.pem").write_text("")
    filled = {k: v.format(d=tmp_path) for k, v in conf.items()}
    with pytest.raises(ValueError, match=match):
        EtcdAccess.from_conf(filled.get, environ={})


def test_the_password_comes_from_the_environment_only_for_a_user() -> None:
    access = EtcdAccess.from_conf({"user": "u"}.get, environ={PASSWORD_ENV: "pw"})
    assert access.password == "pw" and "pw" not in repr(access)
    assert EtcdAccess.from_conf({}.get, environ={PASSWORD_ENV: "pw"}).password is None
