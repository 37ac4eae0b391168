"""http(s) image URLs, fetched only when the router allows them (--allow-image-urls): a time limit
for the whole fetch, a size limit, at most a few redirects, and no hop to a private, loopback,
link-local or otherwise non-public address (the checked address is the one connected to, so a
name that resolves differently a moment later cannot slip through)."""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from router.images.decode import ImageError, ImageLimits

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)


def public_address(address: str, port: int) -> bool:
    """Whether a fetch may connect to `address`: a global unicast address only."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def fetch_image(
    url: str,
    limits: ImageLimits,
    allowed: Callable[[str, int], bool] = public_address,
) -> bytes:
    """The body of `url`, following redirects. `allowed(address, port)` decides every hop's
    address (tests pass one that admits their own loopback server, and only it)."""
    deadline = time.monotonic() + limits.url_timeout
    for _ in range(MAX_REDIRECTS + 1):
        status, location, body = _get(url, limits, allowed, deadline)
        if status not in REDIRECTS:
            if status != 200:
                raise ImageError(f"the image URL answered HTTP {status}")
            return body
        if not location:
            raise ImageError(f"the image URL answered HTTP {status} without a Location")
        url = urljoin(url, location)
    raise ImageError(f"the image URL redirects more than {MAX_REDIRECTS} times")


def _get(url: str, limits: ImageLimits, allowed, deadline: float):
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageError("an image URL must be data:, http: or https:")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _resolve(parts.hostname, port, allowed)
    connection = _connection(parts.scheme, parts.hostname, address, port, _left(deadline))
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={"Host": parts.netloc, "Accept": "image/*"})
        response = connection.getresponse()
        if response.status in REDIRECTS:
            return response.status, response.getheader("Location"), b""
        return response.status, None, _read(response, limits, deadline)
    except (OSError, http.client.HTTPException) as error:
        if isinstance(error, TimeoutError) or time.monotonic() >= deadline:
            raise ImageError(
                f"the image URL did not answer within {limits.url_timeout} seconds"
            ) from None
        raise ImageError(f"the image URL could not be fetched: {error}") from None
    finally:
        connection.close()


def _resolve(host: str, port: int, allowed) -> str:
    """The one address the fetch connects to: every address the name has must be allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise ImageError(f"the image URL's host {host!r} does not resolve") from None
    addresses = [info[4][0] for info in infos]
    refused = [a for a in addresses if not allowed(a, port)]
    if refused or not addresses:
        raise ImageError(
            f"the image URL's host {host!r} is a private or local address ({refused[0]}): refused"
        )
    return addresses[0]


def _connection(scheme: str, host: str, address: str, port: int, timeout: float):
    if scheme == "http":
        connection = http.client.HTTPConnection(address, port, timeout=timeout)
    else:
        connection = _PinnedHTTPS(address, port, timeout=timeout, server_hostname=host)
    return connection


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to an address already checked, verifying the certificate for the URL's host name."""

    def __init__(self, address: str, port: int, timeout: float, server_hostname: str):
        super().__init__(address, port, timeout=timeout, context=ssl.create_default_context())
        self.server_hostname = server_hostname

    def connect(self):
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.server_hostname)


def _read(response, limits: ImageLimits, deadline: float) -> bytes:
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > limits.max_bytes:
        raise ImageError(f"an image is larger than {limits.max_bytes} bytes")
    body = bytearray()
    while chunk := response.read(64 * 1024):
        body += chunk
        if len(body) > limits.max_bytes:
            raise ImageError(f"an image is larger than {limits.max_bytes} bytes")
        if time.monotonic() >= deadline:
            raise ImageError(f"the image URL did not answer within {limits.url_timeout} seconds")
    return bytes(body)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ImageError("the image URL did not answer in time")
    return left
