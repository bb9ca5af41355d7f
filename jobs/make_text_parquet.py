"""Write byte-level tokenized text to parquet for jobs/text.yaml.

The text is Python's own standard library source (always there, offline). Each row is one
window of seq_len + 1 byte tokens (vocab 256: a byte is a token), the model's input plus the
next-token targets. Rows go to several files so the data path reads across files.

Usage: python jobs/make_text_parquet.py OUT_DIR [--rows N] [--seq-len 32] [--files 4]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def stdlib_bytes(limit: int) -> bytes:
    out, n = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        n += len(data)
        if n >= limit:
            break
    return b"".join(out)[:limit]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--files", type=int, default=4)
    args = p.parse_args(argv)
    width = args.seq_len + 1
    tokens = np.frombuffer(stdlib_bytes(args.rows * width), dtype=np.uint8)
    rows = len(tokens) // width
    windows = tokens[:rows * width].reshape(rows, width).astype(np.int32)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(rows), args.files)):
        flat = pa.array(windows[part].ravel())
        pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(flat, width)}),
                       out / f"text-{i:03d}.parquet", row_group_size=1024)
    print(f"wrote {rows} rows of {width} byte tokens to {args.files} files under {out}")


if __name__ == "__main__":
    main()
