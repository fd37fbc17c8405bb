"""Byte sizes: read from a config (`6GiB`), written for people (`1.50 GiB`, `90.3 MiB`)."""

from __future__ import annotations

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
