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
    admin = false                   # may load, unload, offload, pin, unpin and reload
    requests_per_second = 20        # optional limits; over one: 429 with Retry-After
    concurrent_requests = 8
    tokens_per_minute = 200000      # prompt + completion (or input) tokens
    weight = 1.0                    # share of a busy model's queue against other keys
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from packserve import atomic
from packserve.errors import ConfigError, RateLimited

log = logging.getLogger("packserve.auth")

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
    requests_per_second: float | None = Field(default=None, gt=0)
    concurrent_requests: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    weight: float = Field(default=1.0, gt=0, le=1000)

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
    requests_per_second: float | None = None
    concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0

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
                        models=tuple(entry.models), admin=entry.admin,
                        requests_per_second=entry.requests_per_second,
                        concurrent_requests=entry.concurrent_requests,
                        tokens_per_minute=entry.tokens_per_minute, weight=entry.weight))
    return tuple(keys)


class KeyRing:
    """The keys of one keys file, re-read when the file changes.

    `find` is called on the event loop for every request: it stats the file at most once per
    RECHECK_S and re-reads it only when its size, mtime or inode moved. A file that turns bad
    keeps the keys read before (logged by the caller through `error`), so a half-written edit
    never locks everyone out or lets everyone in.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
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
            self._checked = self._clock()
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
                if message != self.error:  # once per problem, not on every re-check
                    log.warning("keys file not reloaded; the keys read before stay in force: %s",
                                message)
                self.error = message
                return False
            self._stamp, self._keys, self.error = stamp, keys, None
            return True

    def find(self, presented: str) -> Key | None:
        """The key whose digest matches `presented`, compared against every key."""
        if self._clock() - self._checked >= RECHECK_S:
            self.reload()
        wanted = digest(presented)
        found = None
        for key in self._keys:
            if hmac.compare_digest(key.digest, wanted):
                found = key
        return found


def _block(key: Key) -> str:
    scope = ", ".join(_toml_string(m) for m in key.models)
    lines = [f"name = {_toml_string(key.name)}", f'sha256 = "{key.digest.hex()}"',
             f"models = [{scope}]", f"admin = {'true' if key.admin else 'false'}"]
    lines += [f"{name} = {value}" for name, value in (
        ("requests_per_second", key.requests_per_second),
        ("concurrent_requests", key.concurrent_requests),
        ("tokens_per_minute", key.tokens_per_minute)) if value is not None]
    if key.weight != 1.0:
        lines.append(f"weight = {key.weight}")
    return "\n[[keys]]\n" + "\n".join(lines) + "\n"


def mint(path: Path, name: str, models: Sequence[str], admin: bool, *,
         requests_per_second: float | None = None, concurrent_requests: int | None = None,
         tokens_per_minute: int | None = None, weight: float = 1.0) -> str:
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
        fh.write(_block(Key(name=name, digest=digest(key), models=tuple(models or ["*"]),
                            admin=admin, requests_per_second=requests_per_second,
                            concurrent_requests=concurrent_requests,
                            tokens_per_minute=tokens_per_minute, weight=weight)))
    parse_keys(path.read_text("utf-8"), str(path))  # what was written reads back
    return key


def revoke(path: Path, name: str) -> None:
    """Remove the key named `name`: the file is rewritten (atomically) from the keys it keeps."""
    keys = parse_keys(path.read_text("utf-8"), str(path))
    if not any(k.name == name for k in keys):
        raise ConfigError(f"{path} has no key named {name!r} (it has: "
                          f"{', '.join(k.name for k in keys) or 'none'})")
    text = "# packserve API keys: digests only (packserve keys create|list|revoke)\n" + "".join(
        _block(k) for k in keys if k.name != name)
    atomic.write_text(path, text, mode=0o600)


def _toml_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


class KeyLimits:
    """Each key's own limits: requests per second and tokens per minute (token buckets) and
    requests at once. State is kept by key name, limits are read from the key on every call
    (a reloaded file changes them at once). Called on the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, tuple[float, float]] = {}  # name -> (tokens, at)
        self._tokens: dict[str, tuple[float, float]] = {}
        self._running: dict[str, int] = {}

    def admit(self, key: Key) -> None:
        """Count a request in, or raise RateLimited naming the limit and when to retry."""
        now = self._clock()
        if key.concurrent_requests is not None and \
                self._running.get(key.name, 0) >= key.concurrent_requests:
            raise RateLimited(f"key {key.name!r} has {key.concurrent_requests} requests "
                              f"running, its concurrent_requests limit", retry_after_s=1)
        if key.tokens_per_minute is not None:
            level = self._level(self._tokens, key.name, key.tokens_per_minute / 60.0,
                                key.tokens_per_minute, now)
            if level <= 0:
                wait = math.ceil((1 - level) / (key.tokens_per_minute / 60.0))
                raise RateLimited(f"key {key.name!r} used its tokens_per_minute limit of "
                                  f"{key.tokens_per_minute}; retry in {wait}s",
                                  retry_after_s=wait)
        if key.requests_per_second is not None:
            rate = key.requests_per_second
            level = self._level(self._requests, key.name, rate, max(1.0, rate), now)
            if level < 1:
                wait = math.ceil((1 - level) / rate)
                raise RateLimited(f"key {key.name!r} is over its requests_per_second limit of "
                                  f"{rate:g}; retry in {wait}s", retry_after_s=wait)
            self._requests[key.name] = (level - 1, now)
        self._running[key.name] = self._running.get(key.name, 0) + 1

    def release(self, key: Key, tokens: int) -> None:
        """A request admitted by `admit` ended, having used `tokens`."""
        self._running[key.name] = max(0, self._running.get(key.name, 0) - 1)
        if key.tokens_per_minute is not None and tokens:
            now = self._clock()
            level = self._level(self._tokens, key.name, key.tokens_per_minute / 60.0,
                                key.tokens_per_minute, now)
            self._tokens[key.name] = (level - tokens, now)  # may go below zero: it waits

    def _level(self, buckets: dict[str, tuple[float, float]], name: str, rate: float,
               capacity: float, now: float) -> float:
        level, at = buckets.get(name, (capacity, now))
        level = min(capacity, level + (now - at) * rate)
        buckets[name] = (level, now)
        return level
