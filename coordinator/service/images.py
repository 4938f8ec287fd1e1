"""Which container images a `command` job may run in: the operator's allowlist.

A `command` job runs any program its submitter names, so it is code execution on the
engine's machine; the image bounds what that program can be. `coordinator serve
--allowed-image PATTERN` (repeatable) lists the images allowed, each an exact reference
or a glob whose `*` matches within one path part (`registry.example/team/*`,
`trainer:*`); without any, only the service's own `--docker-image`. References are
compared as written: `python:3.12` and `docker.io/library/python:3.12` are two names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_REFERENCE = 255
# A reference: [host[:port]/]path[:tag][@digest], lower-case path parts joined by / and
# separators ., _, __ or dashes; a tag of word characters, dots and dashes.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*(?::[0-9]{{1,5}})?/)"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(
    rf"^{_HOST}?{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$"
)  # fmt: skip


def check_reference(text: str) -> str:
    """`text` if it is an image reference, else ValueError saying why."""
    if not text or len(text) > MAX_REFERENCE or not REFERENCE.match(text):
        raise ValueError(
            f"{text[:80]!r} is not an image reference ([HOST[:PORT]/]NAME[:TAG][@DIGEST], "
            f"lower-case name, at most {MAX_REFERENCE} characters)"
        )
    return text


def check_pattern(pattern: str) -> str:
    """`pattern` if it is a reference, or one once each `*` stands for a word."""
    try:
        check_reference(pattern.replace("*", "x"))
    except ValueError:
        raise ValueError(
            f"{pattern[:80]!r} is not an image name or glob (e.g. trainer:* or host/team/*)"
        ) from None
    return pattern


def _glob(pattern: str) -> re.Pattern[str]:
    """`*` matches any run of characters but `/`; everything else stands for itself."""
    return re.compile("[^/]*".join(re.escape(part) for part in pattern.split("*")) + r"\Z")


@dataclass(frozen=True)
class ImagePolicy:
    """The docker launcher's images: its default and those a `command` job may name."""

    default: str
    allowed: tuple[str, ...] = ()  # patterns; empty: only `default`

    @classmethod
    def of(cls, default: str, allowed: Sequence[str] = ()) -> ImagePolicy:
        """Checked: ValueError names the first pattern that is none."""
        return cls(default, tuple(check_pattern(p) for p in allowed))

    def image_of(self, requested: str | None) -> str:
        """The image a `command` job runs in: its own, else the service's default."""
        return requested or self.default

    def allows(self, image: str) -> bool:
        patterns = self.allowed or (self.default,)
        return any(_glob(pattern).match(image) for pattern in patterns)

    def check(self, requested: str | None) -> str:
        """The job's image if allowed, else ValueError naming the allowed ones."""
        image = self.image_of(requested)
        if not self.allows(image):
            allowed = ", ".join(self.allowed or (self.default,))
            raise ValueError(f"image {image!r} is not allowed here (allowed: {allowed})")
        return image
