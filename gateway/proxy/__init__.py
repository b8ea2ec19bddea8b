"""The OpenAI-compatible proxy for black-box agents: forward, capture exact tokens, record."""

from gateway.proxy.call import ProxyCall, parse_request
from gateway.proxy.scope import Scope, TrajectoryBook, scope_of
from gateway.proxy.service import ProxyService
from gateway.proxy.upstream import Upstream, UpstreamFailure

__all__ = [
    "ProxyCall",
    "ProxyService",
    "Scope",
    "TrajectoryBook",
    "Upstream",
    "UpstreamFailure",
    "parse_request",
    "scope_of",
]
