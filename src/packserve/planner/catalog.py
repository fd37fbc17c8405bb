"""The planner's data files: GPUs, prices and model families (`planner/data/*.toml`).

Each file is dated (`as_of`) and names its sources; `load_*` read them once per call, so a
test or a user can pass another file with the same shape.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from packserve.planner.sizing import Architecture

GB = 1_000_000_000


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    bandwidth_gbs: float
    power_w: int
    interconnect: str
    nvlink: bool
    source: str


@dataclass(frozen=True)
class Price:
    """Rent of one GPU: per hour (billed per second) and flat-rate per month."""

    hourly: float
    flat_monthly: float | None = None


@dataclass(frozen=True)
class PriceList:
    currency: str
    as_of: str
    prices: dict[str, Price]
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str
    n_params: int
    arch: Architecture
    typical: bool
    source: str


def _read(name: str, path: Path | None) -> dict[str, object]:
    if path is not None:
        return tomllib.loads(path.read_text("utf-8"))
    text = resources.files("packserve.planner").joinpath("data", name).read_text("utf-8")
    return tomllib.loads(text)


def _rows(raw: dict[str, object], key: str) -> list[dict[str, object]]:
    rows = raw.get(key, [])
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def _table(raw: dict[str, object], key: str) -> dict[str, dict[str, object]]:
    table = raw.get(key, {})
    if not isinstance(table, dict):
        return {}
    return {str(k): v for k, v in table.items() if isinstance(v, dict)}


def _num(row: dict[str, object], key: str, default: float = 0.0) -> float:
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def load_gpus(path: Path | None = None) -> list[Gpu]:
    return [
        Gpu(name=str(r["name"]), memory_bytes=round(_num(r, "memory_gb") * GB),
            bandwidth_gbs=_num(r, "bandwidth_gbs"), power_w=int(_num(r, "power_w")),
            interconnect=str(r.get("interconnect", "")), nvlink=bool(r.get("nvlink", False)),
            source=str(r.get("source", "")))
        for r in _rows(_read("gpus.toml", path), "gpu")
    ]


def load_prices(path: Path | None = None) -> PriceList:
    raw = _read("prices.toml", path)
    prices = {}
    for name, row in _table(raw, "price").items():
        flat = row.get("flat_monthly")
        prices[name] = Price(hourly=_num(row, "hourly"),
                             flat_monthly=_num(row, "flat_monthly") if flat is not None else None)
    sources = raw.get("sources", [])
    return PriceList(currency=str(raw.get("currency", "EUR")), as_of=str(raw.get("as_of", "")),
                     prices=prices,
                     sources=tuple(str(s) for s in sources) if isinstance(sources, list) else ())


def load_families(path: Path | None = None) -> dict[str, Family]:
    out = {}
    for name, r in _table(_read("families.toml", path), "family").items():
        out[name] = Family(
            name=name, n_params=round(_num(r, "params")), typical=bool(r.get("typical", False)),
            source=str(r.get("source", "")),
            arch=Architecture(n_layers=int(_num(r, "layers")), hidden_size=int(_num(r, "hidden")),
                              n_heads=int(_num(r, "heads")), n_kv_heads=int(_num(r, "kv_heads")),
                              head_dim=int(_num(r, "head_dim")), ffn_size=int(_num(r, "ffn")),
                              vocab_size=int(_num(r, "vocab"))))
    return out


def typical_family(n_params: int, families: dict[str, Family]) -> Family:
    """The `typical = true` family nearest to `n_params` on a log scale."""
    typical = [f for f in families.values() if f.typical]
    return min(typical, key=lambda f: abs(math.log(f.n_params / n_params)))
