"""How `actstore write` decodes text files (--encoding, --errors), with counts.

- strict (default): a document that does not decode fails the run before the model loads,
  naming the file (and line) and the options that would read it;
- replace: undecodable bytes become U+FFFD; the documents touched are counted;
- skip: documents that do not decode are left out; they are counted.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from actstore.errors import DataError

ERRORS = ("strict", "replace", "skip")


@dataclass
class Decoding:
    """An encoding and an error policy, and what they did (counted while checking the data)."""

    encoding: str = "utf-8"
    errors: str = "strict"
    seen: int = 0
    replaced: int = 0
    skipped: int = 0
    _noted: set = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.errors not in ERRORS:
            raise DataError(f"--errors must be one of {list(ERRORS)}. Got {self.errors!r}.")
        try:
            self.encoding = codecs.lookup(self.encoding).name
        except LookupError:
            raise DataError(
                f"--encoding {self.encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, cp1252)"
            ) from None

    def check(self, raw: bytes, where: str) -> bool:
        """Count one document; False when it is to be left out (skip). Strict: raises."""
        self.seen += 1
        try:
            raw.decode(self.encoding)
            return True
        except UnicodeDecodeError as e:
            if self.errors == "strict":
                raise DataError(
                    f"{where}: not {self.encoding} text ({e.reason} at byte {e.start}); pass --encoding (e.g. latin-1) "
                    "if it is another encoding, or --errors replace|skip to replace its undecodable bytes or leave it out"
                ) from None
            if self.errors == "skip":
                self.skipped += 1
                return False
            self.replaced += 1
            return True

    def decode(self, raw: bytes) -> str:
        return raw.decode(self.encoding, errors="replace" if self.errors == "replace" else "strict")

    def report(self) -> str | None:
        """One line saying what replace or skip did (None when nothing was touched)."""
        if self.skipped:
            return (
                f"--errors skip: {self.skipped} of {self.seen} documents not decodable as {self.encoding} were left out"
            )
        if self.replaced:
            return f"--errors replace: undecodable bytes replaced (U+FFFD) in {self.replaced} of {self.seen} documents"
        return None
