"""Bad input that names what to fix, so each front end can point at it: the CLI at its
option, the API at the request field."""

from __future__ import annotations


class FieldError(ValueError):
    """A value that is refused; `field` names where it came from (`--etcd-cert`, `params.data`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
