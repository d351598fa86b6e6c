"""Rewrite a wheel without the members a device call does not need, so that the carried wheels fit the device tool's
64 MiB (with the tracked tree). bitsandbytes 0.50.2's wheel (43 MB) holds one native library per CUDA and ROCm
version; the GPU image's torch is built for CUDA 13.0, which loads libbitsandbytes_cuda130.so:

    python benchmarks/slim_wheel.py BNB.whl .whl/ --keep-lib cuda130 cpu

Each dropped member's line leaves the wheel's RECORD too, so the rewritten wheel is consistent; the name stays.
"""

from __future__ import annotations

import argparse
import re
import zipfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--keep-lib", nargs="+", required=True,
                        help="suffixes of the libbitsandbytes_<suffix>.so libraries to keep (e.g. cuda130 cpu)")
    args = parser.parse_args()
    native = re.compile(r"(^|/)libbitsandbytes_(\w+)\.(so|dylib|dll)$")

    def keep(name: str) -> bool:
        match = native.search(name)
        return match is None or match.group(2) in args.keep_lib

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / args.wheel.name
    dropped = []
    with zipfile.ZipFile(args.wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if not keep(info.filename):
                dropped.append(info.filename)
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if keep(line.split(",", 1)[0])) + "\n").encode()
            dst.writestr(info, data)
    print(f"{out}: dropped {len(dropped)} members, {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
