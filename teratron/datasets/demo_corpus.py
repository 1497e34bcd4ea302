"""The default data of `teratron train` with no data flags: real English prose, built offline.

The text is what every CPython install carries: the language reference of `pydoc_data/topics.py`
(read with `ast`, never imported) and the docstrings of the standard library's modules, classes
and functions. Code, doctests, grammar and lines that are mostly symbols are dropped; each kept
paragraph is one line of plain text and each topic or docstring one document.

A small byte-level BPE (`DEMO_VOCAB_SIZE` tokens, `<|endoftext|>` = eod) is trained on it with
the `tokenizers` library, and the documents are written as a Megatron `.bin/.idx`:

    demo = prepare_demo_data("~/.cache/teratron")
    demo.data_prefix      # --data-path
    demo.tokenizer_model  # --tokenizer-type HuggingFaceTokenizer --tokenizer-model

Everything is cached under `cache_dir/demo-<hash>`, the hash covering the source files, the
build settings and the `tokenizers` version. One caller builds while concurrent ones (one per
rank) wait on a file lock; the build goes to a scratch folder renamed into place, so a crash
never leaves a half-written cache.
"""

import ast
import fcntl
import hashlib
import json
import os
import re
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass

import numpy
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from teratron.datasets.indexed_dataset import DType, IndexedDatasetBuilder

DEMO_VOCAB_SIZE = 4096
EOD_TOKEN = "<|endoftext|>"
_BUILD_VERSION = 1  # bump when the cleaning or the tokenizer recipe changes
# Folders of the standard library whose docstrings are not prose (tests, demos, codecs tables).
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "ensurepip",
              "pydoc_data", "site-packages", "dist-packages", "__pycache__"}
_ROLE = re.compile(r":[\w:.-]+:`~?([^`<]*?)\s*(?:<[^>]*>)?`")  # :func:`name` -> name
_MARKUP = re.compile(r"``([^`]*)``|`([^`]*)`|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*")  # literals, emphasis
_BULLET = re.compile(r"^(?:[*+-]|\d+\.|\(\w\))\s+")
_CODE_SYMBOLS = re.compile(r"[_=\[\]{}<>*/\\|@#$%^&~+`]")


@dataclass(frozen=True)
class DemoData:
    data_prefix: str       # path prefix of the .bin/.idx pair (no extension)
    tokenizer_model: str   # tokenizer.json for HuggingFaceTokenizer
    vocab_size: int
    num_tokens: int        # tokens in the .bin, eod included


def prepare_demo_data(cache_dir=None) -> DemoData:
    """Build (once) and return the demo corpus and its tokenizer."""
    cache_dir = os.path.expanduser(os.fspath(cache_dir or _default_cache_dir()))
    sources = _source_files()
    out_dir = os.path.join(cache_dir, f"demo-{_content_hash(sources)}")
    if not os.path.isfile(os.path.join(out_dir, "meta.json")):
        os.makedirs(cache_dir, exist_ok=True)
        with open(os.path.join(cache_dir, ".demo.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent callers wait for one build
            if not os.path.isfile(os.path.join(out_dir, "meta.json")):
                scratch = tempfile.mkdtemp(prefix=".demo-build-", dir=cache_dir)
                try:
                    _build(sources, scratch)
                    _publish(scratch, out_dir)
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    return DemoData(
        data_prefix=os.path.join(out_dir, "demo_text_document"),
        tokenizer_model=os.path.join(out_dir, "tokenizer.json"),
        vocab_size=meta["vocab_size"],
        num_tokens=meta["num_tokens"],
    )


def _default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "teratron")


def _publish(scratch: str, out_dir: str):
    try:
        os.rename(scratch, out_dir)
    except OSError:
        if not os.path.isfile(os.path.join(out_dir, "meta.json")):
            raise  # not a concurrent builder winning the race: a real failure


def _source_files() -> list[str]:
    """topics.py, then the standard library's .py files in a fixed (sorted) order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("test"))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return [os.path.join(stdlib, "pydoc_data", "topics.py")] + files


def _content_hash(sources: list[str]) -> str:
    digest = hashlib.sha256(
        f"{_BUILD_VERSION} {DEMO_VOCAB_SIZE} {tokenizers.__version__}".encode())
    for path in sources:
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def demo_documents(sources: list[str] | None = None) -> list[str]:
    """The cleaned corpus: one string per topic or docstring, paragraphs separated by newlines."""
    sources = sources or _source_files()
    raw = list(_topics(sources[0]))
    for path in sources[1:]:
        raw += _docstrings(path)
    documents, seen = [], set()
    for text in raw:
        doc = clean_text(text)
        if doc and doc not in seen:
            seen.add(doc)
            documents.append(doc)
    return documents


def _topics(path: str):
    with open(path, "rb") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            yield from ast.literal_eval(node.value).values()


def _docstrings(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, ValueError):  # a file written for another Python version
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return [d for d in docs if d]


def clean_text(text: str) -> str:
    """Keep the prose paragraphs of reST-ish text, each joined into one line."""
    kept = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.split("\n")]
        if any(line.startswith((">>>", "...")) for line in lines):
            continue  # an interactive session
        prose = " ".join(line for line in lines if any(c.isalnum() for c in line))  # no rules
        prose = _BULLET.sub("", prose)
        prose = _MARKUP.sub(lambda m: next(g for g in m.groups() if g is not None), _ROLE.sub(r"\1", prose))
        prose = re.sub(r"\s+", " ", prose).strip()
        if _is_prose(prose):
            kept.append(prose)
    return "\n".join(kept)


def _is_prose(text: str) -> bool:
    """Sentences of mostly words: not code, grammar, tables, signatures or headings."""
    words = text.split()
    return (len(words) >= 6
            and (text[0].isalpha() or text[0] in "\"'(")
            and text[-1] in ".:?!)"
            and len(_CODE_SYMBOLS.findall(text)) <= 0.03 * len(text)
            and sum(w.strip(".,:;()\"'?!").isalpha() for w in words) >= 0.8 * len(words))


def _train_tokenizer(documents: list[str]) -> Tokenizer:
    """Byte-level BPE; the trainer breaks ties by pair order, so the result is deterministic."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def _build(sources: list[str], out_dir: str):
    documents = demo_documents(sources)
    tokenizer = _train_tokenizer(documents)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN}, f)

    eod = tokenizer.token_to_id(EOD_TOKEN)
    vocab_size = tokenizer.get_vocab_size()
    prefix = os.path.join(out_dir, "demo_text_document")
    num_tokens = 0
    with IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size)) as builder:
        for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
            ids = encoding.ids + [eod]  # Megatron's preprocess --append-eod
            builder.add_document(numpy.array(ids), [len(ids)])
            num_tokens += len(ids)
        builder.finalize(prefix + ".idx")
    meta = {"vocab_size": vocab_size, "num_tokens": num_tokens, "num_documents": len(documents)}
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
