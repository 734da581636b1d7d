"""HTTPS: the server speaks TLS when given a certificate and its key (vLLM's ``--ssl-*`` flags),
and asks clients for certificates of their own when told to (mutual TLS)."""
from __future__ import annotations

import ssl
from dataclasses import dataclass

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclass(frozen=True, slots=True)
class Tls:
    certfile: str | None = None
    keyfile: str | None = None         # None: the key is in certfile
    ca_certs: str | None = None        # CAs whose client certificates are accepted
    cert_reqs: int = ssl.CERT_NONE     # whether a client must show a certificate
    ciphers: str | None = None         # OpenSSL cipher list (TLS 1.2 and below)

    @property
    def on(self) -> bool:
        return self.certfile is not None

    def check(self) -> None:
        """ValueError naming the flag where the settings cannot make a context."""
        if self.keyfile is not None and self.certfile is None:
            raise ValueError("ssl-keyfile: needs --ssl-certfile")
        if not self.on and (self.ca_certs or self.cert_reqs != ssl.CERT_NONE or self.ciphers):
            raise ValueError("ssl-ca-certs, ssl-cert-reqs and ssl-ciphers need --ssl-certfile")
        if self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise ValueError("ssl-cert-reqs: client certificates are checked against --ssl-ca-certs; give it")
        if self.on:
            self.context()

    def context(self) -> ssl.SSLContext | None:
        """The server's context (None without a certificate); ValueError for a file that cannot be
        read or a key that does not match its certificate."""
        if not self.on:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile, password=_no_passphrase)
        except _Encrypted:
            raise ValueError(f"ssl-keyfile: the key in {self.keyfile or self.certfile} is encrypted; give one "
                             "without a passphrase (openssl pkey -in KEY -out PLAIN)") from None
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"ssl-certfile: cannot use {self.certfile}"
                             f"{'' if self.keyfile is None else ' with ' + self.keyfile}: {_why(e)}") from None
        if self.ca_certs is not None:
            try:
                ctx.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"ssl-ca-certs: cannot use {self.ca_certs}: {_why(e)}") from None
        ctx.verify_mode = self.cert_reqs
        if self.ciphers:
            try:
                ctx.set_ciphers(self.ciphers)
            except ssl.SSLError:
                raise ValueError(f"ssl-ciphers: no cipher matches {self.ciphers!r}") from None
        return ctx


def cert_reqs(value: str) -> int:
    """vLLM's ``--ssl-cert-reqs`` (0, 1, 2: the ssl module's CERT_NONE, _OPTIONAL, _REQUIRED), or
    the words."""
    if value.lower() in CERT_REQS:
        return CERT_REQS[value.lower()]
    if value in ("0", "1", "2"):
        return int(value)
    raise ValueError(f"ssl-cert-reqs: 0 (none), 1 (optional) or 2 (required), got {value!r}")


class _Encrypted(Exception):
    pass


def _no_passphrase():
    """Asked for where the key is encrypted: refused, instead of OpenSSL prompting on a terminal."""
    raise _Encrypted


def _why(e: OSError) -> str:
    if isinstance(e, ssl.SSLError):               # a bad PEM, a key that is not the certificate's
        return str(e.reason or e).replace("_", " ").lower()
    return e.strerror or str(e)
