"""A small deterministic mutational fuzzer: hostile variants of valid inputs.

Coverage-guided fuzzers (atheris, hypothesis) spend most of their time choosing what to
try; at the million-execution scale of campaign 5 that costs more than the parsers
under test (hypothesis draws about a hundred structured examples a second here). This
engine does no search: it starts from valid seeds and stacks a few mutations of the
kinds that break parsers (bit flips, byte inserts, deletes and splices, truncation,
interesting integers in text and in binary length fields, JSON type swaps, removed and
duplicated keys, deep nesting, NaN and Infinity). Every choice comes from the
`random.Random` it is given, so an execution is reproduced from its seed alone.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
from typing import Any

INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    7,
    8,
    127,
    128,
    255,
    256,
    4095,
    4096,
    65535,
    65536,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64,
    10**30,
    -(10**30),
    10**400,
)
INTERESTING_FLOATS = (0.0, -0.0, 0.5, 1e-320, 1e308, math.nan, math.inf, -math.inf)
INTERESTING_TEXT = (
    "",
    " ",
    ".",
    "..",
    "../",
    "../../etc/passwd",
    "/etc/passwd",
    "/",
    "a/b",
    "a\\b",
    "\x00",
    "nul\x00byte",
    "\ud800",
    "ä",
    "\u202e",
    "ステップ",
    "A" * 300,
    "B" * 5000,
    "step-000000000004",
    "rank-00000.safetensors",
    "manifest.json",
    "F32",
    "BF16",
    "I64",
    "U8",
    "BOOL",
    "F8_E4M3",
    "cuda:7",
    "meta",
    "__class__",
    "__reduce__",
    "os.system",
    "builtins.eval",
    "NaN",
    "-1",
    "0x10",
)
INTERESTING_BYTES = (0x00, 0xFF, 0x7F, 0x80, 0x22, 0x5C, 0x7B, 0x7D, 0x5B, 0x5D, 0x2C, 0x3A, 0x0A)
_KEYS = ("step", "tree", "files", "tensors", "dtype", "shape", "digest", "run_id", "event")
_NUMBER = re.compile(rb"[0-9]+")
_DUP = "\u0001dup\u0001"
_DEEP = "\u0001deep\u0001"


class Mutator:
    """Hostile variants of bytes and of JSON documents, drawn from ``rng``."""

    def __init__(self, rng: random.Random, corpus: list[bytes]) -> None:
        self.rng = rng
        self.corpus = corpus  # other seeds, for splices

    # ------------------------------------------------------------------ values

    def integer(self) -> int:
        r = self.rng
        n = r.choice(INTERESTING_INTS)
        return n + r.choice((0, 0, 0, -1, 1)) if r.random() < 0.8 else r.randint(-1000, 1 << 40)

    def text(self) -> str:
        r = self.rng
        if r.random() < 0.7:
            return r.choice(INTERESTING_TEXT)
        return "".join(chr(r.choice((r.randint(32, 126), r.randint(0, 0x2FFF)))) for _ in range(8))

    def value(self, depth: int = 0) -> Any:
        """A JSON value of any type (floats include NaN and the infinities)."""
        r = self.rng
        kind = r.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return r.random() < 0.5
        if kind == 2:
            return self.integer()
        if kind == 3:
            return r.choice(INTERESTING_FLOATS) if r.random() < 0.7 else r.uniform(-1e9, 1e9)
        if kind in (4, 5):
            return self.text()
        if kind == 6:
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        if kind == 7:
            return {self.text(): self.value(depth + 1) for _ in range(r.randrange(4))}
        return _DEEP  # nesting deeper than any recursion limit, spliced in as text

    # ------------------------------------------------------------------ bytes

    def damage(self, data: bytes, rounds: int | None = None) -> bytes:
        """``data`` with one to four stacked byte-level mutations."""
        r = self.rng
        b = bytearray(data)
        for _ in range(rounds or r.randint(1, 4)):
            op = r.randrange(12)
            n = len(b)
            i = r.randrange(n + 1)
            if op == 0 and n:  # bit flip
                b[min(i, n - 1)] ^= 1 << r.randrange(8)
            elif op == 1 and n:  # interesting byte
                b[min(i, n - 1)] = r.choice(INTERESTING_BYTES)
            elif op == 2:  # random bytes inserted
                b[i:i] = r.randbytes(r.randint(1, 16))
            elif op == 3 and n:  # a range deleted
                del b[i : i + r.randint(1, 64)]
            elif op == 4 and n:  # a range duplicated
                j = r.randrange(n)
                b[i:i] = b[j : j + r.randint(1, 64)]
            elif op == 5 and self.corpus:  # a chunk of another seed spliced in
                other = r.choice(self.corpus)
                j = r.randrange(len(other) + 1)
                chunk = other[j : j + r.randint(1, 256)]
                if r.random() < 0.5:
                    b[i : i + len(chunk)] = chunk
                else:
                    b[i:i] = chunk
            elif op == 6:  # a number in the text replaced by an interesting one
                b = bytearray(self._renumber(bytes(b)))
            elif op == 7:  # a binary integer (a length field) written over the bytes
                width = r.choice((1, 2, 4, 8))
                v = self.integer() % (1 << (8 * width))
                b[i : i + width] = v.to_bytes(width, "little")
            elif op == 8 and n:  # truncated
                del b[i:]
            elif op == 9:  # nesting
                depth = r.choice((64, 1000, 3000, 100_000))
                b[i:i] = (b"[" if r.random() < 0.5 else b'{"a":') * depth
            elif op == 10:  # an interesting token
                token = r.choice(
                    (b"NaN", b"Infinity", b"-Infinity", b"1e400", b"null", b'"\\ud800"')
                )
                b[i:i] = token
            elif n:  # two chunks swapped
                j = r.randrange(n)
                k = r.randint(1, 32)
                if i + k <= j:
                    b[i : i + k], b[j : j + k] = b[j : j + k], b[i : i + k]
        return bytes(b)

    def _renumber(self, data: bytes) -> bytes:
        r = self.rng
        numbers = [m.span() for m in _NUMBER.finditer(data)]
        if not numbers:
            return data
        i, j = r.choice(numbers)
        if r.random() < 0.8:
            number = str(self.integer()).encode()
        else:
            number = r.choice((b"1e400", b"-0", b"1.5"))
        return data[:i] + number + data[j:]

    # ------------------------------------------------------------------ JSON

    def edit(self, doc: Any, rounds: int | None = None) -> Any:
        """A copy of the JSON document ``doc`` with one to three structural edits."""
        out = copy.deepcopy(doc)
        for _ in range(rounds or self.rng.randint(1, 3)):
            out = self._edit(out)
        return out

    def _edit(self, doc: Any) -> Any:
        r = self.rng
        paths = _paths(doc)
        if not paths:
            return self.value()
        path = r.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        old = parent[key]
        op = r.randrange(8)
        if op == 0:  # removed
            del parent[key]
        elif op == 1 and isinstance(old, dict):  # a key added
            old[self.text()] = self.value()
        elif op == 2 and isinstance(old, list):  # an item added
            old.insert(r.randrange(len(old) + 1), self.value())
        elif op == 3:  # copied from elsewhere in the document
            src = r.choice(paths)
            node = doc
            for k in src:
                node = node[k]
            parent[key] = copy.deepcopy(node)
        elif op == 4:  # wrapped
            parent[key] = [old] if r.random() < 0.5 else {"value": old}
        elif op == 5 and isinstance(old, dict):  # a duplicate key, spliced in as text
            old[_DUP] = self.value(2)
        elif op == 6 and isinstance(old, (int, float)) and not isinstance(old, bool):
            parent[key] = self.integer() if r.random() < 0.7 else r.choice(INTERESTING_FLOATS)
        else:  # another value of any type
            parent[key] = self.value()
        return doc

    def dumps(self, doc: Any) -> bytes:
        """``doc`` as JSON text in one of several spellings, with the duplicate keys and
        deep nesting `edit` planted spliced in."""
        r = self.rng
        try:
            text = json.dumps(
                doc,
                ensure_ascii=r.random() < 0.7,
                separators=(",", ":") if r.random() < 0.5 else None,
                indent=1 if r.random() < 0.1 else None,
            )
        except (ValueError, RecursionError):
            return b"{}"
        deep = json.dumps(_DEEP)
        text = self._splice_dups(text)
        while deep in text:
            depth = r.choice((100, 1000, 5000))
            opener = "[" if r.random() < 0.5 else '{"a":'
            closer = "]" if opener == "[" else "}"
            text = text.replace(deep, opener * depth + "0" + closer * depth, 1)
        return text.encode("utf-8", "surrogatepass")

    def _splice_dups(self, text: str) -> str:
        """Each planted ``_DUP`` key renamed to a key its object already has."""
        dup_key = json.dumps(_DUP)
        while dup_key in text:
            name = self.rng.choice(_KEYS)
            text = text.replace(dup_key, json.dumps(name), 1)
        return text


def _paths(doc: Any, path: tuple[Any, ...] = (), limit: int = 4000) -> list[tuple[Any, ...]]:
    """Paths to the values inside ``doc`` (not the root itself), at most ``limit``."""
    out: list[tuple[Any, ...]] = []
    todo: list[tuple[tuple[Any, ...], Any]] = [(path, doc)]
    while todo and len(out) < limit:
        p, node = todo.pop()
        if p:
            out.append(p)
        if isinstance(node, dict):
            todo.extend(((*p, k), v) for k, v in node.items())
        elif isinstance(node, list):
            todo.extend(((*p, i), v) for i, v in enumerate(node))
    return out
