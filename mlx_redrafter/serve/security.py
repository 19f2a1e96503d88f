"""Who may drive ``serve``: the ``Host`` names it answers to, the browser
origins it lets in, and the API key it asks for.

A local model server is reachable from every web page the user opens. A page
cannot read a reply from another origin, but it can rebind its own name to
127.0.0.1 (DNS rebinding, CVE-2024-28224 in Ollama) and then drive the server
as a same-origin page, or post to it blind. So, by default:

* the ``Host`` header must be a loopback name (``localhost``, ``127.0.0.1``,
  ``[::1]``) or the address the server is bound to (any port); bound to all
  interfaces (``0.0.0.0``, ``::``) it may also be any IP address (a rebound
  page always sends its own *name*) or this machine's name. ``--allow-host``
  adds names; anything else is a 403 that names the flag;
* a request with an ``Origin`` header must come from the server's own origin
  (the chat page) or an ``--allow-origin`` (also ``MLX_REDRAFTER_ORIGINS``,
  comma-separated, as ``OLLAMA_ORIGINS``), which get CORS headers and
  preflights; any other origin is a 403. Requests without ``Origin`` (curl,
  SDKs) are not browsers' and pass;
* with ``--api-key`` (or ``MLX_REDRAFTER_API_KEY``) every route but the chat
  page's files and ``/health`` needs the key, as ``Authorization: Bearer KEY``
  (OpenAI's and Ollama's clients) or ``x-api-key: KEY`` (Anthropic's); a
  missing or wrong key is a 401.

Refusals are answered in the error shape of the API the path belongs to (the
``refuse`` callable :func:`secure` is given).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import Response

from ..errors import RedrafterError
from .streaming import FORBIDDEN, UNAUTHORIZED, Failure

LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
KEY_ENV = "MLX_REDRAFTER_API_KEY"
ORIGINS_ENV = "MLX_REDRAFTER_ORIGINS"
# What needs no key: the chat page's files (it asks for the key itself) and the health probe.
PUBLIC_PATHS = ("/", "/health")
PUBLIC_PREFIXES = ("/ui/",)
# Where a request that passed the Host check is marked (a key of the ASGI scope).
_HOST_OK = "mlx_redrafter.host_ok"

Refuse = Callable[[str, Failure], Response]


@dataclass(frozen=True)
class SecurityConfig:
    """What ``serve`` trusts, resolved once from its flags (:meth:`resolve`).

    ``hosts``: the ``Host`` names accepted (Starlette's patterns: ``*`` any,
    ``*.example.com``); ``ip_hosts``: any IP address too; ``origins``: the
    browser origins let in beside the server's own (``*`` any; a ``*`` in
    one matches any run of characters but ``/``); ``api_key``: the key every
    route but the public ones needs (None: no key); ``bind``: the address the
    server listens on (for :meth:`warnings`)."""

    hosts: Tuple[str, ...] = LOOPBACK
    ip_hosts: bool = False
    origins: Tuple[str, ...] = ()
    api_key: Optional[str] = None
    bind: str = "127.0.0.1"

    @classmethod
    def resolve(
        cls,
        bind: str = "127.0.0.1",
        api_key: Optional[str] = None,
        allow_hosts: Sequence[str] = (),
        allow_origins: Sequence[str] = (),
        environ: Mapping[str, str] = os.environ,
    ) -> "SecurityConfig":
        """The config of ``--host BIND --api-key KEY --allow-host H... --allow-origin O...``
        (the key and more origins also from ``environ``); a bad value is a
        :class:`RedrafterError` naming its flag."""
        if api_key is None:
            api_key = environ.get(KEY_ENV) or None
        if api_key is not None and not api_key.strip():
            raise RedrafterError("--api-key is empty.", f"Give a key (or unset {KEY_ENV}), or leave the flag out.")
        origins = list(allow_origins) + [o for o in environ.get(ORIGINS_ENV, "").split(",") if o.strip()]
        hosts = _bound_names(bind) + tuple(_host_pattern(h) for h in allow_hosts)
        return cls(
            hosts=hosts,
            ip_hosts=_is_wildcard(bind),
            origins=tuple(_origin(o) for o in origins),
            api_key=api_key,
            bind=bind,
        )

    def warnings(self) -> List[str]:
        """What this config opens that the user should know of (printed at start)."""
        out = []
        if not _is_loopback(self.bind) and self.api_key is None:
            out.append(
                f"serving on {self.bind} without --api-key: anyone who can reach this address can use the "
                f"model. Give --api-key KEY (or set {KEY_ENV})."
            )
        if "*" in self.hosts:
            out.append("--allow-host '*' accepts any Host header: a web page can reach this server by DNS rebinding.")
        if "*" in self.origins:
            out.append("--allow-origin '*' lets every web page you open use this server.")
        return out

    def cors(self) -> dict:
        """The allowed origins as :class:`CORSMiddleware` arguments."""
        exact = [o for o in self.origins if o == "*" or "*" not in o]
        patterns = [re.escape(o).replace(r"\*", "[^/]*") for o in self.origins if o != "*" and "*" in o]
        return {"allow_origins": exact, "allow_origin_regex": "|".join(patterns) or None}


def secure(app, config: SecurityConfig, refuse: Refuse) -> None:
    """Guard ``app`` as ``config`` says (middlewares, outermost first: the
    Host check, the Origin check with CORS, the key). ``refuse(path,
    failure)`` answers a refusal in the shape of the path's API."""
    if config.api_key is not None:
        app.add_middleware(KeyGuard, key=config.api_key, refuse=refuse)
    # allow_private_network: Chrome asks before a public page's request to a local address;
    # an origin the user allowed may make it.
    app.add_middleware(
        OriginGuard,
        refuse=refuse,
        allow_methods=["*"],
        allow_headers=["*"],
        allow_private_network=True,
        **config.cors(),
    )
    app.add_middleware(HostGuard, config=config, refuse=refuse)


def needs_key(path: str) -> bool:
    """Whether a request for ``path`` needs the API key (when there is one)."""
    return path not in PUBLIC_PATHS and not path.startswith(PUBLIC_PREFIXES)


class HostGuard:
    """The ``Host`` allowlist: Starlette's :class:`TrustedHostMiddleware`
    decides (it would answer a plain-text 400), a refusal is our 403."""

    def __init__(self, app, config: SecurityConfig, refuse: Refuse):
        self.app, self.refuse, self.ip_hosts = app, refuse, config.ip_hosts
        self.check = TrustedHostMiddleware(_mark_host_ok, allowed_hosts=list(config.hosts), www_redirect=False)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not await self._allowed(scope, receive):
            host = Headers(scope=scope).get("host", "")
            name = urlsplit("//" + host).hostname or host
            message = (
                f"This server does not answer to the Host '{host}' (a web page may be trying DNS rebinding). "
                f"If you reach it by that name, start it with --allow-host {name}."
            )
            return await self.refuse(scope["path"], Failure(403, message, FORBIDDEN))(scope, receive, send)
        await self.app(scope, receive, send)

    async def _allowed(self, scope, receive) -> bool:
        if self.ip_hosts and _is_ip(Headers(scope=scope).get("host", "")):
            return True
        await self.check(scope, receive, _drop)  # marks the scope when the host is allowed
        return scope.pop(_HOST_OK, False)


async def _mark_host_ok(scope, receive, send) -> None:
    scope[_HOST_OK] = True


async def _drop(message) -> None:
    """Where the Host check's own refusal goes (ours is sent instead)."""


class OriginGuard(CORSMiddleware):
    """Browser origins: Starlette's CORS (headers and preflights) for the
    allowed ones; a request from any other origin, not the server's own, is a 403."""

    def __init__(self, app, refuse: Refuse, **cors):
        super().__init__(app, **cors)
        self.refuse = refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if (
                origin is not None
                and not _same_origin(origin, headers.get("host", ""))
                and not self.is_allowed_origin(origin)
            ):
                message = (
                    f"Requests from the web page at '{origin}' are refused. To let that page use this "
                    f"server, start it with --allow-origin {origin} (or add it to {ORIGINS_ENV})."
                )
                return await self.refuse(scope["path"], Failure(403, message, FORBIDDEN))(scope, receive, send)
        await super().__call__(scope, receive, send)


class KeyGuard:
    """The API key, on every route but the public ones (:func:`needs_key`)."""

    def __init__(self, app, key: str, refuse: Refuse):
        self.app, self.key, self.refuse = app, key.encode(), refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and needs_key(scope["path"]):
            given = presented_key(Headers(scope=scope))
            # compare_digest: the time taken says nothing about how much of the key was right.
            if given is None or not hmac.compare_digest(given.encode(), self.key):
                problem = "needs an API key" if given is None else "was given a wrong API key"
                message = (
                    f"This server {problem}: send the --api-key it was started with as "
                    "'Authorization: Bearer KEY' (or 'x-api-key: KEY')."
                )
                response = self.refuse(scope["path"], Failure(401, message, UNAUTHORIZED))
                response.headers["WWW-Authenticate"] = 'Bearer realm="mlx-redrafter"'
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def presented_key(headers: Headers) -> Optional[str]:
    """The key a request carries: ``Authorization: Bearer KEY`` (OpenAI,
    Ollama) or ``x-api-key: KEY`` (Anthropic); None without one."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


# --------------------------------------------------------------------------- resolving the flags


def _is_wildcard(bind: str) -> bool:
    return bind in WILDCARD_BINDS


def _is_loopback(bind: str) -> bool:
    try:
        return bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def _is_ip(host_header: str) -> bool:
    try:
        ipaddress.ip_address(urlsplit("//" + host_header).hostname or "")
        return True
    except ValueError:
        return False


def _bound_names(bind: str) -> Tuple[str, ...]:
    """The Host names a server bound to ``bind`` answers to by default."""
    if _is_wildcard(bind):  # reached by any of this machine's addresses, or its name
        name = socket.gethostname().lower()
        return LOOPBACK + tuple(dict.fromkeys([name, name if "." in name else f"{name}.local"]))
    bound = f"[{bind}]" if ":" in bind else bind.lower()
    return LOOPBACK + (() if bound in LOOPBACK else (bound,))


def _host_pattern(host: str) -> str:
    """An ``--allow-host`` value as a Host pattern (a port given is dropped:
    the check is on the name)."""
    value = host.strip().lower()
    if value != "*":
        value = urlsplit("//" + value).hostname or ""
        value = f"[{value}]" if ":" in value else value
    if not value or "*" in value[1:] or (value.startswith("*") and value != "*" and not value.startswith("*.")):
        raise RedrafterError(
            f"--allow-host {host!r} is not a host name.",
            "Give a name (my-mac.local), an address (192.168.1.5), '*.example.com', or '*' (any).",
        )
    return value


def _origin(origin: str) -> str:
    """An ``--allow-origin`` value checked and normalized (browsers send
    ``scheme://host[:port]``, lower case, no path)."""
    value = origin.strip().lower().rstrip("/")
    parts = urlsplit(value)
    if value != "*" and (not parts.scheme or not parts.netloc or parts.path or parts.query):
        raise RedrafterError(
            f"--allow-origin {origin!r} is not an origin.",
            "Give scheme://host[:port], e.g. http://localhost:3000 (a '*' matches any part), or '*' (any web page).",
        )
    return value


def _same_origin(origin: str, host_header: str) -> bool:
    """Whether ``origin`` is the server's own, as the browser reached it (the Host header)."""
    try:
        parts, host = urlsplit(origin), urlsplit("//" + host_header)
        default = {"http": 80, "https": 443}.get(parts.scheme)
        return bool(parts.hostname) and (parts.hostname, parts.port or default) == (host.hostname, host.port or default)
    except ValueError:  # a port that is not a number
        return False
