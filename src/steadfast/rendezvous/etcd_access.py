"""How the etcd store reaches a secured etcd, as production sites run it: TLS with a CA
and a client certificate, and etcd's own authentication (a user and a password).

The options are ``--rdzv-conf`` entries under etcdctl's names (``cacert``, ``cert``,
``key``, ``user``, ``password``) or torch's etcd rendezvous aliases (``ca_cert``,
``ssl_cert``, ``ssl_cert_key``). The password is better not on the command line, where
``ps`` shows it to every user of the node: ``password_file=PATH`` or
``$STEADFAST_ETCD_PASSWORD`` (a ``password=`` works, with a warning).

etcd's JSON gateway (what :mod:`.etcd` speaks) does not authenticate by a certificate's
Common Name, as etcd's gRPC API does: with auth on, it refuses every request that comes
with a client certificate holding a CN (HTTP 400, "CommonName of client sending a
request against gateway will be ignored"). So behind auth, the client certificate must
have no CN, and the user is a user with a password; a user that exists only as a
certificate (etcdctl's CN login) cannot use the gateway.

A user's token (``/v3/auth/authenticate``) is kept per member: a simple token expires
after ``--auth-token-ttl`` (300 s by default) unused, which is what an idle launcher
meets at the moment of a fault, and a token is refused when the auth store changed
since it was issued ("revision of auth store is old"). Either answer renews it once and
repeats the request (:meth:`EtcdAccess.renews`).
"""

from __future__ import annotations

import http.client
import logging
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PASSWORD_ENV", "EtcdAccess"]

logger = logging.getLogger(__name__)

#: The environment variable a launcher reads the etcd user's password from.
PASSWORD_ENV = "STEADFAST_ETCD_PASSWORD"

#: ``--rdzv-conf`` names: etcdctl's first, then torch's etcd rendezvous aliases.
_NAMES = {"cacert": ("cacert", "ca_cert"), "cert": ("cert", "ssl_cert"),
          "key": ("key", "ssl_cert_key")}  # fmt: skip


@dataclass
class EtcdAccess:
    """TLS files and a user for the etcd store; empty: plain HTTP, no auth."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    https: bool = False  # an ``https://`` endpoint: TLS with the system's CAs at least
    _context: ssl.SSLContext | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def tls(self) -> bool:
        return self.https or any((self.cacert, self.cert, self.key))

    @classmethod
    def from_conf(
        cls,
        get: Callable[[str], object],
        https: bool = False,
        environ: Mapping[str, str] = os.environ,
    ) -> EtcdAccess:
        """The access that ``--rdzv-conf`` (``get(name)``: a value or None) asks for.
        Raises ``ValueError`` naming the option for a missing file, a certificate without
        its key, a user without a password (or the other way round)."""

        def option(names: tuple[str, ...]) -> tuple[str, str] | None:
            given = [(n, str(get(n)).strip()) for n in names if get(n) not in (None, "")]
            if len(given) > 1:
                raise ValueError(
                    f"rdzv-conf: {given[0][0]} and {given[1][0]} name the same etcd option"
                )
            return given[0] if given else None

        files: dict[str, str | None] = {}
        for what, names in _NAMES.items():
            found = option(names)
            if found is not None and not os.access(found[1], os.R_OK):
                raise ValueError(f"rdzv-conf {found[0]}: {found[1]!r} is not a readable file")
            files[what] = found[1] if found else None
        if (files["cert"] is None) != (files["key"] is None):
            raise ValueError(
                "rdzv-conf: a client certificate needs its key: give both cert (ssl_cert) "
                "and key (ssl_cert_key)"
            )
        user = option(("user",))
        inline, from_file = option(("password",)), option(("password_file",))
        if user is None and (inline or from_file):
            raise ValueError("rdzv-conf: an etcd password was given without user=")
        password = _password(inline, from_file, environ) if user else None
        if user is not None and password is None:
            raise ValueError(
                f"rdzv-conf user={user[1]}: no password (password_file=PATH or "
                f"${PASSWORD_ENV}); etcd's JSON gateway has no login by certificate"
            )
        return cls(
            cacert=files["cacert"], cert=files["cert"], key=files["key"],
            user=user[1] if user else None, password=password, https=https,
        )  # fmt: skip

    def context(self) -> ssl.SSLContext | None:
        """The TLS context (built once), or None for plain HTTP."""
        if not self.tls:
            return None
        if self._context is None:
            try:
                ctx = ssl.create_default_context(cafile=self.cacert)
                if self.cert is not None:
                    ctx.load_cert_chain(self.cert, self.key)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"rdzv-conf cacert={self.cacert} cert={self.cert} key={self.key}: "
                    f"cannot be used for TLS: {exc}"
                ) from exc
            self._context = ctx
        return self._context

    def connect(self, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
        """A connection to a member (not opened yet: the first request opens it, and it
        stays open: one TLS handshake per connection, not per request)."""
        ctx = self.context()
        if ctx is None:
            return http.client.HTTPConnection(host, port, timeout=timeout)
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)

    @staticmethod
    def renews(status: int, body: bytes) -> bool:
        """Whether etcd's answer asks for a new token: an unknown or expired one (401,
        gRPC code 16), or one issued before the auth store changed."""
        return status == 401 or b"revision of auth store is old" in body

    def error(self, where: str, status: int, body: bytes) -> str:
        """What a failed answer says: :meth:`refusal`'s clear message where it has one,
        else the status and the start of the body."""
        return self.refusal(where, status, body) or f"etcd {where}: {status} {body[:200]!r}"

    def refusal(self, where: str, status: int, body: bytes) -> str | None:
        """A clear message for an answer that no retry or other member changes (None:
        not one of them)."""
        text = body[:300].decode(errors="replace").strip()
        if b"CommonName of client" in body:
            return (
                f"etcd {where} refuses the client certificate {self.cert}: it has a Common "
                "Name, and etcd's JSON gateway takes no login by certificate while auth is "
                "on. Use a certificate without a CN, and user= with a password"
            )
        if b"invalid user ID or password" in body:
            return f"etcd {where}: user {self.user!r} or its password is wrong ({text})"
        if status == 403 or b"permission denied" in body:
            who = f"user {self.user!r}" if self.user else "a client with no user= (auth is on)"
            return f"etcd {where}: {who} may not do this ({text})"
        if b"user name is empty" in body or b"user name not found" in body:
            return f"etcd {where} requires a user: give user= and a password ({text})"
        return None

    def tls_error(self, where: str, exc: ssl.SSLError) -> str:
        """What a failed TLS handshake says, naming the option to look at."""
        if isinstance(exc, ssl.SSLCertVerificationError):
            return (
                f"etcd {where}: its certificate is not trusted by cacert={self.cacert} "
                f"({exc.verify_message})"
            )
        return (
            f"etcd {where}: the TLS handshake failed ({exc.reason or exc}); the member may "
            f"not accept the client certificate cert={self.cert}, or want one"
        )


def _password(
    inline: tuple[str, str] | None, from_file: tuple[str, str] | None, environ: Mapping[str, str]
) -> str | None:
    sources = [s for s in (inline, from_file) if s is not None]
    if len(sources) > 1:
        raise ValueError("rdzv-conf: password and password_file both given: choose one")
    if from_file is not None:
        try:
            return Path(from_file[1]).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"rdzv-conf password_file: {exc}") from None
    if inline is not None:
        logger.warning(
            "rdzv-conf password=: the etcd password is on the command line, where ps shows "
            "it to every user of this node; prefer password_file=PATH or $%s",
            PASSWORD_ENV,
        )
        return inline[1]
    return environ.get(PASSWORD_ENV) or None
