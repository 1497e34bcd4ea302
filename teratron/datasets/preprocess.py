"""`teratron preprocess`: JSONL (optionally .gz) -> Megatron `.bin/.idx`, as Megatron's
`tools/preprocess_data.py` does.

Each line is one JSON object; for every `--json-keys` key its text (or list of sentences) becomes
one document of `{output_prefix}_{key}_document.bin/.idx`, in input order, with the tokenizer's
EOD appended under `--append-eod`. `--workers` tokenize in parallel; `--partitions` split the
input into contiguous line ranges processed side by side (workers shared among them) and merged,
so the output bytes do not depend on either. Outputs appear only when complete.
"""

import argparse
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, List, Optional, Tuple

from tqdm import tqdm

from teratron.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

_LEVEL = "document"
# The state workers need, set before forking so nothing is pickled (tokenizers need not be).
_ENCODER = None
_PARTITION_JOB = None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's preprocess flags, tokenizer flags included."""
    from teratron.tokenizers import add_tokenizer_args

    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="JSONL file (one JSON object per line), optionally gzip-compressed (.gz).")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Keys whose text to tokenize; one output dataset per key.")
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true",
                       help="Append the tokenizer's end-of-document token to every document.")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="Output path prefix: writes {prefix}_{key}_document.bin/.idx.")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="Tokenizer processes in all; a multiple of --partitions.")
    group.add_argument("--partitions", type=int, default=1,
                       help="Split the input into this many parts processed in parallel, then merged.")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="Report throughput every this many documents.")
    return parser


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_{_LEVEL}"


def run(args: argparse.Namespace, tokenizer=None) -> int:
    """Preprocess `args.input`; returns 0. `tokenizer` overrides the one the flags describe."""
    _check_args(args)
    if tokenizer is None:
        from teratron.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(args)
    if args.append_eod:
        _check_has_eod(tokenizer)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    global _ENCODER
    _ENCODER = _Encoder(args.input, list(args.json_keys), args.append_eod, tokenizer)
    start = time.time()
    if args.partitions == 1:
        counts = _process_range(args, dtype, 0, None, args.output_prefix, args.workers, "")
    else:
        counts = _process_partitions(args, dtype)
    docs, tokens = counts
    print(f"preprocess: {docs} documents, {tokens} tokens in {time.time() - start:.1f}s -> "
          + ", ".join(get_bin_path(output_prefix_for_key(args.output_prefix, k)) for k in args.json_keys),
          file=sys.stderr)
    return 0


def _check_args(args) -> None:
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input}: file not found")
    if args.workers < 1 or args.partitions < 1:
        raise ValueError(f"--workers ({args.workers}) and --partitions ({args.partitions}) must be >= 1")
    if args.workers % args.partitions != 0:
        raise ValueError(f"--workers {args.workers} must be a multiple of --partitions {args.partitions} "
                         f"(each partition gets workers / partitions processes)")
    if args.log_interval < 1:
        raise ValueError(f"--log-interval must be >= 1 (got {args.log_interval})")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ValueError(f"--json-keys {' '.join(args.json_keys)}: a key is repeated")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist; "
                         f"create it first")


def _check_has_eod(tokenizer) -> None:
    """--append-eod needs the tokenizer's end-of-document id: ask for it before any worker starts."""
    try:
        tokenizer.eod  # noqa: B018 (a tokenizer without one raises AttributeError)
    except AttributeError as err:
        raise ValueError(f"--append-eod: {err}; or drop --append-eod") from None


class _Encoder:
    """Line -> token ids per key (documents as Megatron builds them)."""

    def __init__(self, input_path: str, json_keys: List[str], append_eod: bool, tokenizer) -> None:
        self.input_path = input_path
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.tokenizer = tokenizer

    def encode(self, numbered_line: Tuple[int, str]):
        """(line number, line) -> ({key: (ids, sentence lengths)}, bytes of the line)."""
        lineno, line = numbered_line
        where = f"{self.input_path}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        out = {}
        for key in self.json_keys:
            if key not in data:
                raise ValueError(f"{where}: no key {key!r} (keys: {', '.join(map(repr, data))}); "
                                 f"choose the text field with --json-keys")
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            if not all(isinstance(s, str) for s in sentences):
                raise ValueError(f"{where}: {key!r} must be a string or a list of strings")
            ids, lengths = [], []
            for sentence in sentences:
                sentence_ids = self.tokenizer.tokenize(sentence)
                if len(sentence_ids) > 0:
                    ids.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
                lengths[-1] += 1
            out[key] = (ids, lengths)
        return out, len(line)


def _encode_in_worker(numbered_line):
    return _ENCODER.encode(numbered_line)


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _numbered_lines(path: str, start: int, stop: Optional[int]):
    """(1-based line number, line) of lines [start, stop), blank lines skipped."""
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(itertools.islice(f, start, stop), start=start + 1):
                if line.strip():
                    yield lineno, line
        except (UnicodeDecodeError, EOFError, OSError) as err:
            raise ValueError(f"{path}: cannot read the input ({err}); give UTF-8 JSONL, "
                             f"optionally gzip-compressed") from None


def _process_range(args, dtype, start: int, stop: Optional[int], output_prefix: str, workers: int,
                   label: str) -> Tuple[int, int]:
    """Tokenize lines [start, stop) into `output_prefix`'s datasets; returns (docs, tokens)."""
    builders: Dict[str, IndexedDatasetBuilder] = {}
    pool = None
    try:
        for key in args.json_keys:
            builders[key] = IndexedDatasetBuilder(get_bin_path(output_prefix_for_key(output_prefix, key)),
                                                  dtype=dtype)
        lines = _numbered_lines(args.input, start, stop)
        if workers > 1:
            pool = multiprocessing.get_context("fork").Pool(workers)
            encoded = pool.imap(_encode_in_worker, lines, 32)  # imap keeps input order
        else:
            encoded = map(_ENCODER.encode, lines)
        docs = tokens = total_bytes = 0
        begin = time.time()
        total = None if stop is None else stop - start
        with tqdm(total=total, unit="doc", desc=f"preprocess{label}", disable=None, file=sys.stderr) as bar:
            for doc, num_bytes in encoded:
                for key, (ids, lengths) in doc.items():
                    builders[key].add_document(ids, lengths)
                    tokens += len(ids)
                docs += 1
                total_bytes += num_bytes
                bar.update(1)
                if docs % args.log_interval == 0:
                    elapsed = max(time.time() - begin, 1e-9)
                    bar.write(f"Processed {docs} documents{label} ({docs / elapsed:.1f} docs/s, "
                              f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr)
        for key, builder in builders.items():
            builder.finalize(get_idx_path(output_prefix_for_key(output_prefix, key)))
        return docs, tokens
    except BaseException:
        for builder in builders.values():
            builder.discard()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()


def _count_lines(path: str) -> int:
    with _open_text(path) as f:
        try:
            return sum(1 for _ in f)
        except (UnicodeDecodeError, EOFError, OSError) as err:
            raise ValueError(f"{path}: cannot read the input ({err})") from None


def _run_partition(i: int) -> Tuple[int, int]:
    args, dtype, bounds = _PARTITION_JOB
    workers = args.workers // args.partitions
    return _process_range(args, dtype, bounds[i], bounds[i + 1], _partition_prefix(args, i), workers,
                          f" [part {i}]")


def _partition_prefix(args, i: int) -> str:
    return f"{args.output_prefix}_partition{i}"


def _process_partitions(args, dtype) -> Tuple[int, int]:
    """Contiguous line ranges in parallel processes, merged in order into the final datasets."""
    global _PARTITION_JOB
    num_lines = _count_lines(args.input)
    step = -(-num_lines // args.partitions)
    bounds = [min(i * step, num_lines) for i in range(args.partitions + 1)]
    _PARTITION_JOB = (args, dtype, bounds)
    try:
        with ProcessPoolExecutor(args.partitions, mp_context=multiprocessing.get_context("fork")) as ex:
            results = [f.result() for f in [ex.submit(_run_partition, i) for i in range(args.partitions)]]
        for key in args.json_keys:
            final = output_prefix_for_key(args.output_prefix, key)
            with IndexedDatasetBuilder(get_bin_path(final), dtype=dtype) as builder:
                for i in range(args.partitions):
                    builder.add_index(output_prefix_for_key(_partition_prefix(args, i), key))
                builder.finalize(get_idx_path(final))
    finally:
        for i in range(args.partitions):
            for key in args.json_keys:
                part = output_prefix_for_key(_partition_prefix(args, i), key)
                for path in (get_bin_path(part), get_idx_path(part)):
                    if os.path.exists(path):
                        os.unlink(path)
    return sum(r[0] for r in results), sum(r[1] for r in results)
