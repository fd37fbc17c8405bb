"""API keys: who may call which model, and who may run the admin routes.

The keys file (`server.keys_file`) is TOML and holds only SHA-256 digests of the keys, never a
key: `packserve keys create NAME` mints a key, prints it once and appends its digest. A key is
32 random bytes, so a plain digest is as strong as a slow hash would be (there is nothing to
guess from a dictionary). Every presented key is compared against every digest in constant
time. The file is re-read when it changes (checked at most once a second) and on SIGHUP:
adding, rotating and revoking a key needs no restart.

    [[keys]]
    name = "search-team"            # in logs and metrics; never the key
    sha256 = "9f86d0..."            # hex digest of the key
    models = ["all-minilm-*", "minilm-rerank"]   # names or globs; default ["*"]
    admin = false                   # may load, unload, pin, unpin and reload
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from packserve.errors import ConfigError

KEY_PREFIX = "psk-"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RECHECK_S = 1.0  # how often a request may stat the keys file


class Access(StrEnum):
    """What a route asks of its caller."""

    OPEN = "open"  # anyone who reaches the port: /healthz, /readyz
    KEY = "key"  # any valid key; a model route also checks the key's scope
    ADMIN = "admin"  # an admin key


class _KeyRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    sha256: str
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    admin: bool = False

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("use letters, digits and . _ - (at most 64 characters)")
        return v

    @field_validator("sha256")
    @classmethod
    def _digest_ok(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("must be the 64-character hex SHA-256 digest of the key "
                             "(packserve keys create writes it)")
        return v


@dataclass(frozen=True)
class Key:
    """One caller: a name for logs and metrics, the models it may call, whether it is admin."""

    name: str
    digest: bytes
    models: tuple[str, ...]
    admin: bool

    def may_call(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_keys(text: str, origin: str) -> tuple[Key, ...]:
    """The keys of a keys file's text. Raises ConfigError naming the entry and the reason."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from exc
    unknown = set(raw) - {"keys"}
    if unknown:
        raise ConfigError(f"{origin}: unknown section {sorted(unknown)[0]!r} (only [[keys]])")
    rows = raw.get("keys", [])
    if not isinstance(rows, list):
        raise ConfigError(f"{origin}: keys must be an array of tables ([[keys]])")
    keys: list[Key] = []
    names: set[str] = set()
    for i, row in enumerate(rows):
        try:
            entry = _KeyRow.model_validate(row)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ConfigError(f"{origin}: keys[{i}].{where}: "
                              f"{str(err['msg']).removeprefix('Value error, ')}") from exc
        if entry.name in names:
            raise ConfigError(f"{origin}: keys[{i}].name: two keys are named {entry.name!r}")
        names.add(entry.name)
        keys.append(Key(name=entry.name, digest=bytes.fromhex(entry.sha256),
                        models=tuple(entry.models), admin=entry.admin))
    return tuple(keys)


class KeyRing:
    """The keys of one keys file, re-read when the file changes.

    `find` is called on the event loop for every request: it stats the file at most once per
    RECHECK_S and re-reads it only when its size, mtime or inode moved. A file that turns bad
    keeps the keys read before (logged by the caller through `error`), so a half-written edit
    never locks everyone out or lets everyone in.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self.error: str | None = None
        self._keys: tuple[Key, ...] = ()
        self.reload(strict=True)

    @property
    def keys(self) -> tuple[Key, ...]:
        return self._keys

    def reload(self, *, strict: bool = False) -> bool:
        """Re-read the file if it changed. True if the keys changed. `strict` (at start):
        a missing or bad file raises ConfigError instead of keeping the old keys."""
        with self._lock:
            self._checked = time.monotonic()
            try:
                st = self.path.stat()
                stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
                if stamp == self._stamp:
                    return False
                keys = parse_keys(self.path.read_text("utf-8"), str(self.path))
            except (OSError, ConfigError) as exc:
                message = exc.message if isinstance(exc, ConfigError) else \
                    f"cannot read keys file {self.path}: {exc.strerror}"
                if strict:
                    raise ConfigError(message) from exc
                self.error = message
                return False
            self._stamp, self._keys, self.error = stamp, keys, None
            return True

    def find(self, presented: str) -> Key | None:
        """The key whose digest matches `presented`, compared against every key."""
        if time.monotonic() - self._checked >= RECHECK_S:
            self.reload()
        wanted = digest(presented)
        found = None
        for key in self._keys:
            if hmac.compare_digest(key.digest, wanted):
                found = key
        return found


def _block(name: str, sha256: str, models: Sequence[str], admin: bool) -> str:
    scope = ", ".join(_toml_string(m) for m in models)
    return (f"\n[[keys]]\nname = {_toml_string(name)}\nsha256 = \"{sha256}\"\n"
            f"models = [{scope}]\nadmin = {'true' if admin else 'false'}\n")


def mint(path: Path, name: str, models: Sequence[str], admin: bool) -> str:
    """Append a new key named `name` to the keys file (created 0600) and return the key."""
    if not _NAME.match(name):
        raise ConfigError(f"key name {name!r}: use letters, digits and . _ - "
                          f"(at most 64 characters)")
    existing = parse_keys(path.read_text("utf-8"), str(path)) if path.exists() else ()
    if any(k.name == name for k in existing):
        raise ConfigError(f"{path} already has a key named {name!r}; revoke it first "
                          f"(packserve keys revoke {name}) or pick another name")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as fh:
        fh.write(_block(name, hashlib.sha256(key.encode()).hexdigest(), models or ["*"], admin))
    parse_keys(path.read_text("utf-8"), str(path))  # what was written reads back
    return key


def revoke(path: Path, name: str) -> None:
    """Remove the key named `name`: the file is rewritten (atomically) from the keys it keeps."""
    keys = parse_keys(path.read_text("utf-8"), str(path))
    if not any(k.name == name for k in keys):
        raise ConfigError(f"{path} has no key named {name!r} (it has: "
                          f"{', '.join(k.name for k in keys) or 'none'})")
    text = "# packserve API keys: digests only (packserve keys create|list|revoke)\n" + "".join(
        _block(k.name, k.digest.hex(), k.models, k.admin) for k in keys if k.name != name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _toml_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
