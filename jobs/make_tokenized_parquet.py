"""Train a BPE tokenizer on local text and write tokenized, packed sequences to parquet (jobs/llama.yaml).

Offline, from a clean clone: the text is Python's own standard library source (as
jobs/make_text_parquet.py uses). The tokenizer (`tokenizers`' byte-level BPE) is saved as a
transformers tokenizer folder (OUT_DIR/tokenizer: AutoTokenizer.from_pretrained loads it); the
text is tokenized, an end-of-text token between files, and packed into rows of exactly seq_len
token ids (column `input_ids`, no padding), spread over several parquet files. Each file's
schema metadata records the sequence length, vocabulary size and the tokenizer's folder.

Usage: python jobs/make_tokenized_parquet.py OUT_DIR [--vocab-size 1024] [--seq-len 64] [--rows 20000] [--files 4]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

EOS = "<|endoftext|>"


def stdlib_texts(limit_bytes: int) -> list[str]:
    """Source files of the standard library, in a fixed order, up to `limit_bytes`."""
    out, n = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        n += len(text)
        if n >= limit_bytes:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """A byte-level BPE trained on `texts`, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.save_pretrained(out)
    return fast


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=20_000, help="at most this many packed sequences")
    p.add_argument("--files", type=int, default=4)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # About 3 characters per token at this vocabulary size: read enough text for --rows rows.
    texts = stdlib_texts(args.rows * args.seq_len * 4)
    tokenizer = train_tokenizer(texts, args.vocab_size, out / "tokenizer")
    ids = [i for t in texts for i in tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]]
    rows = min(args.rows, len(ids) // args.seq_len)
    packed = np.asarray(ids[:rows * args.seq_len], dtype=np.int32).reshape(rows, args.seq_len)
    meta = {"seq_len": args.seq_len, "vocab_size": len(tokenizer), "tokenizer": str((out / "tokenizer").resolve())}
    for i, part in enumerate(np.array_split(np.arange(rows), args.files)):
        table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(packed[part].ravel()),
                                                                         args.seq_len)})
        table = table.replace_schema_metadata({"airay": json.dumps(meta)})
        pq.write_table(table, out / f"tokens-{i:03d}.parquet", row_group_size=1024)
    print(f"wrote {rows} sequences of {args.seq_len} tokens (vocab {len(tokenizer)}) to {args.files} files "
          f"under {out}; tokenizer in {out / 'tokenizer'}")


if __name__ == "__main__":
    main()
