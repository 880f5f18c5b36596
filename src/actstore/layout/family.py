"""family.json: the record of an aligned family of member stores (docs/format.md, section 9).

A family is a folder holding `family.json` and one complete actstore store per member under
`members/<name>/`. Every member was written from the same batches, so example i and its
tokens are the same in each; the members differ in width (d_model, d_mlp, n_heads x d_head)
or in the model that produced them. The record names each member, the model it came from
and the sites (hook names) it holds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actstore.errors import CorruptStoreError, FormatVersionError, LayerNotFoundError
from actstore.layout import jsonio

FAMILY_FILE = "family.json"
FAMILY_FORMAT = "actstore-family"
FAMILY_VERSION = 1
MEMBERS_DIR = "members"
MAX_FAMILY_BYTES = 2**20  # a record of thousands of sites is a few hundred KB
MEMBER_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
FAMILY_FIELDS = ("format", "format_version", "members")
MEMBER_FIELDS = ("name", "model", "model_id", "sites", "width")
_NAME = re.compile(MEMBER_NAME_PATTERN)


@dataclass(frozen=True, kw_only=True)
class Member:
    """One member store: `width` wide, holding `sites` of model number `model`."""

    name: str
    model: int
    model_id: str | None
    sites: tuple[str, ...]
    width: int

    @property
    def key(self) -> str:
        """The member's folder, relative to the family root."""
        return f"{MEMBERS_DIR}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "model_id": self.model_id,
            "sites": list(self.sites),
            "width": self.width,
        }


@dataclass(frozen=True)
class Family:
    """The members of a family, in the order family.json lists them."""

    members: tuple[Member, ...]

    def __post_init__(self) -> None:
        problem = _problem(self.members)
        if problem:
            raise ValueError(problem)

    @property
    def n_models(self) -> int:
        return 1 + max(m.model for m in self.members)

    def to_json(self) -> bytes:
        doc = {
            "format": FAMILY_FORMAT,
            "format_version": FAMILY_VERSION,
            "members": [m.to_json() for m in self.members],
        }
        return jsonio.dumps(doc)

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise LayerNotFoundError(f"no member {name!r} in this family; it has {[m.name for m in self.members]}")

    def locate(self, site: str, model: int | None = None) -> Member:
        """The member holding `site` (of model number `model`; None: the only model that has it)."""
        found = [m for m in self.members if site in m.sites and (model is None or m.model == model)]
        if len(found) == 1:
            return found[0]
        if found:
            raise LayerNotFoundError(
                f"site {site!r} is recorded from {len(found)} models ({[m.model_id for m in found]}): "
                f"name one as (model, {site!r}), model a number 0..{self.n_models - 1} or a model id"
            )
        known = sorted({s for m in self.members for s in m.sites if model is None or m.model == model})
        which = "" if model is None else f" of model {model}"
        raise LayerNotFoundError(f"no site {site!r}{which} in this family; it holds {known}")


def parse(data: bytes, where: str) -> Family:
    """A Family from the bytes of family.json; damage is a CorruptStoreError naming `where`."""
    doc = jsonio.loads(data, where, what="family record")
    if not isinstance(doc, dict) or doc.get("format") != FAMILY_FORMAT:
        raise CorruptStoreError(f"{where} is not an actstore family record (format must be {FAMILY_FORMAT!r})")
    version = doc.get("format_version")
    if type(version) is not int or version != FAMILY_VERSION:
        raise FormatVersionError(
            f"{where} has family format_version {version!r}; this actstore reads {FAMILY_VERSION}: upgrade actstore"
        )
    if sorted(doc) != sorted(FAMILY_FIELDS) or not isinstance(doc["members"], list):
        raise CorruptStoreError(f"{where} must have exactly the fields {list(FAMILY_FIELDS)}; it has {sorted(doc)}")
    members = []
    for i, m in enumerate(doc["members"]):
        if not isinstance(m, dict) or sorted(m) != sorted(MEMBER_FIELDS):
            raise CorruptStoreError(f"{where}: member {i} must have exactly the fields {list(MEMBER_FIELDS)}")
        ok = (
            isinstance(m["name"], str)
            and type(m["model"]) is int
            and (m["model_id"] is None or isinstance(m["model_id"], str))
            and isinstance(m["sites"], list)
            and all(isinstance(s, str) for s in m["sites"])
            and type(m["width"]) is int
        )
        if not ok:
            raise CorruptStoreError(f"{where}: member {i} has a field of the wrong type ({m!r})")
        members.append(
            Member(name=m["name"], model=m["model"], model_id=m["model_id"], sites=tuple(m["sites"]), width=m["width"])
        )
    problem = _problem(tuple(members))
    if problem:
        raise CorruptStoreError(f"{where}: {problem}")
    return Family(tuple(members))


def _problem(members: Sequence[Member]) -> str | None:
    """What makes `members` no family (None: nothing)."""
    if not members:
        return "a family needs at least one member"
    names = [m.name for m in members]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        return f"member names must match {MEMBER_NAME_PATTERN}; got {bad}"
    if len(set(names)) != len(names):
        return f"member names must be distinct; got {names}"
    for m in members:
        if m.width <= 0 or m.model < 0 or not m.sites:
            return f"member {m.name!r} needs a width >= 1, a model number >= 0 and at least one site"
    pairs = [(m.model, s) for m in members for s in m.sites]
    if len(set(pairs)) != len(pairs):
        return "each site of a model must be in exactly one member"
    models = sorted({m.model for m in members})
    if models != list(range(len(models))):
        return f"model numbers must be 0..{len(models) - 1}; got {models}"
    return None
