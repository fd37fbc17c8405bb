"""Byte sizes and durations: read from a config (`6GiB`, `5m`), written for people (`1.50 GiB`,
`90.3 MiB`, `1h30m`)."""

from __future__ import annotations

import math
import re

from pydantic import ByteSize, TypeAdapter, ValidationError

MIB = 1 << 20
GIB = 1 << 30
GB = 1_000_000_000

_BYTES = TypeAdapter(ByteSize)


def parse_bytes(value: object) -> int:
    """Parse `6GiB`, `512MiB`, `1.5GB` or a plain integer into bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 6GiB or a number of bytes")
    try:
        n = int(_BYTES.validate_python(value))
    except ValidationError as exc:
        raise ValueError(
            f"{value!r} is not a size (write it like 6GiB, 512MiB or 1000000)") from exc
    if n < 0:
        raise ValueError("a size cannot be negative")
    return n


def format_bytes(n: int, *, decimal: bool = False, compact: bool = False) -> str:
    """`n` bytes for people: GiB from 1 GiB up, MiB below (two and one decimals in messages;
    one and none with `compact`, for tables). `decimal` writes GB from 1 GB up, as cards are
    sold (one decimal); small models stay in MiB."""
    if decimal:
        return f"{n / GB:.1f} GB" if abs(n) >= GB else f"{n / MIB:.{0 if compact else 1}f} MiB"
    if abs(n) >= GIB:
        return f"{n / GIB:.{1 if compact else 2}f} GiB"
    return f"{n / MIB:.{0 if compact else 1}f} MiB"


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_DURATION_S = 1e12  # longer is never (and an integer too large for a float is no error)


def parse_duration(value: object) -> float:
    """Seconds from `300`, `"90s"`, `"5m"`, `"1h30m"` or `"250ms"` (Ollama's `keep_alive`
    forms); `"never"` or a negative number is `math.inf`."""
    if isinstance(value, bool):
        raise ValueError("expected a duration (write it like 5m, 90s, 1h30m, 300 or never)")
    if isinstance(value, (int, float)) and value == value:  # not NaN
        return math.inf if value < 0 or value > MAX_DURATION_S else float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "never":
            return math.inf
        try:
            return parse_duration(float(text))  # "300", "-1": seconds, as Ollama reads them
        except ValueError:
            pass
        parts = _DURATION.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return parse_duration(sum(float(n) * _SECONDS[u] for n, u in parts))
    raise ValueError(f"{value!r} is not a duration (write it like 5m, 90s, 1h30m, 300 "
                     f"or never)")


def format_duration(seconds: float) -> str:
    """`seconds` as a config would write it: `never`, `90s`, `5m`, `1h30m`."""
    if math.isinf(seconds):
        return "never"
    whole = int(seconds)
    if whole != seconds or whole < 60:
        return f"{seconds:g}s"
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{n}{u}" for n, u in ((h, "h"), (m, "m"), (s, "s")) if n)
