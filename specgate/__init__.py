"""specgate: an SLA-aware gateway between speculative and plain vLLM pools.

One import name for the whole project. The repository keeps each room as a top-level folder
(`gateway/`, `policies/`, `workers/`, ...); `specgate/` links them in as subpackages, so
`specgate.gateway` is `gateway/` both in a checkout and in an installed wheel. The rooms and the
one direction their imports run: docs/architecture.md.
"""

__version__ = "0.1.0"
