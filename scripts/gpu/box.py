"""What `gpu-check.sh --prepared` asks of the GPU machine's own Python, standard library only
(the machine may lack `xz`; its `python3` is itself a virtual environment).

    python3 box.py site-dirs              lines for a .pth file: this interpreter's site dirs
    python3 box.py cuda-libs              folders holding libcudart/libcublas(Lt) .so.13
    python3 box.py find NAME              the first nvidia/**/NAME in the site dirs (cuBLAS's
                                          headers and libraries, for a build on the card)
    python3 box.py xz SRC DST             compress to .xz (where the machine has no xz)
    python3 box.py unxz SRC DST           decompress an .xz file
    python3 box.py untar SRC DIR          unpack a .tar.xz
    python3 box.py pack-logs DIR OUT MB   DIR's files, each cut to its last MB, into OUT (.tar.xz)
    python3 box.py env-report DIR STEPS   the environment steps (STEPS, "name ok|FAILED seconds")
                                          into DIR/report.json and report.txt, or those alone
"""

from __future__ import annotations

import io
import json
import lzma
import shutil
import sys
import tarfile
import time
from pathlib import Path

CUDA_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13")


def site_dirs() -> list[str]:
    """This interpreter's site-packages folders, in its own order. A venv made from a venv (the
    GPU machine's python3 is /opt/torch/.venv) sees only the *base* interpreter's packages with
    --system-site-packages; a .pth whose lines call site.addsitedir on these gives it the
    parent venv's own (torch, numpy, nvidia-ml-py), .pth files in them processed too."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))
            and Path(p).is_dir()]


def cuda_libs() -> list[str]:
    """Folders with CUDA 13's runtime and cuBLAS from the NVIDIA wheels on sys.path (torch's)."""
    found: list[str] = []
    for sp in site_dirs():
        for name in CUDA_LIBS:
            for hit in sorted(Path(sp).glob(f"nvidia/**/{name}")):
                if str(hit.parent) not in found:
                    found.append(str(hit.parent))
    return found


def pack_logs(folder: Path, out: Path, mib: float) -> None:
    """Every file under `folder`, each cut to its last `mib` MiB, into one .tar.xz at `out`
    ($OUT holds at most 8 files: the logs travel as one)."""
    keep = int(mib * (1 << 20))
    with tarfile.open(out, "w:xz") as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            with path.open("rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - keep))
                data = f.read()
            info = tarfile.TarInfo(str(path.relative_to(folder)))
            info.size = len(data)
            info.mtime = int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))


def env_report(folder: Path, steps_file: Path) -> None:
    """The environment steps (STEPS: "name ok|FAILED seconds" lines) into the report: added to
    check.py's as `box_steps`, or, for a run that stopped before check.py wrote one, a report
    of them alone, the failed one last."""
    steps: dict[str, dict[str, object]] = {}
    lines = steps_file.read_text("utf-8").splitlines() if steps_file.exists() else []
    for line in lines:
        name, verdict, seconds = [*line.split(), "", ""][:3]
        steps[f"box:{name}"] = {"ok": verdict == "ok", "seconds": float(seconds or 0),
                                **({} if verdict == "ok" else {"error": "see its log in "
                                                               "logs.tar.xz"})}
    rows = [f"{n:<24} {'yes' if s['ok'] else 'NO':<5} {s['seconds']:>8}"
            for n, s in steps.items()]
    report = folder / "report.json"
    if report.exists():
        body = json.loads(report.read_text("utf-8"))
        body["box_steps"] = steps
        report.write_text(json.dumps(body, indent=2) + "\n", "utf-8")
        with (folder / "report.txt").open("a", encoding="utf-8") as txt:
            txt.write("\nthe environment's steps (gpu-check.sh)\n" + "\n".join(rows) + "\n")
        return
    # check.py writes its report from its first step on: none means it never ran or died at once
    failed = [n for n, s in steps.items() if not s["ok"]] or ["box: check.py wrote no report "
                                                             "(check.log in logs.tar.xz)"]
    body = {"check": "packserve prepared GPU check (scripts/gpu-check.sh)",
            "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "steps": steps, "failed": failed}
    report.write_text(json.dumps(body, indent=2) + "\n", "utf-8")
    text = ["packserve prepared GPU check: stopped before the steps on the card", "", *rows]
    (folder / "report.txt").write_text("\n".join(text) + "\n", "utf-8")


def main(argv: list[str]) -> int:
    verb, *rest = argv
    if verb == "site-dirs":
        print("\n".join(f"import site; site.addsitedir({d!r})" for d in site_dirs()))
    elif verb == "cuda-libs":
        print(":".join(cuda_libs()))
    elif verb == "find":
        hits = [h for sp in site_dirs() for h in sorted(Path(sp).glob(f"nvidia/**/{rest[0]}"))]
        if not hits:
            return 1
        print(hits[0])
    elif verb == "xz":
        with open(rest[0], "rb") as src, lzma.open(rest[1], "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    elif verb == "unxz":
        with lzma.open(rest[0]) as src, open(rest[1], "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    elif verb == "untar":
        with tarfile.open(rest[0], "r:xz") as tar:
            tar.extractall(rest[1], filter="data")
    elif verb == "pack-logs":
        pack_logs(Path(rest[0]), Path(rest[1]), float(rest[2]))
    elif verb == "env-report":
        env_report(Path(rest[0]), Path(rest[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
