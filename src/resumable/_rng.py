"""The process-wide random streams: captured, checked and put back.

`rng_state` reads Python's ``random``, NumPy's global generator, torch's CPU generator
and each initialised CUDA device's generator. `check_rng_state` tries a recorded state
on throwaway generators, so a restore refuses a bad one before it touches any stream.

`PythonState` and `NumpyState` read Python's and NumPy's streams anew only when they
changed: they compare the state where it lies in memory. Anything unexpected turns
them off, and each read then costs what ``getstate`` costs.
"""

from __future__ import annotations

import array
import ctypes
import functools
import random
import struct
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from resumable.errors import CorruptCheckpointError


def rng_state(
    numpy_state: Callable[[], Any] | None = None, python_state: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """The process-wide random streams, as plain values and tensors; ``numpy_state`` and
    ``python_state`` stand in for ``np.random.get_state(legacy=False)`` and
    ``random.getstate()`` (`resumable._capture_plan`)."""
    out: dict[str, Any] = {
        "python": random.getstate() if python_state is None else python_state(),
        "numpy": np.random.get_state(legacy=False) if numpy_state is None else numpy_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized() and torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state_all()
    return out


# What a malformed state makes the generators' own setters raise.
_SETTER_ERRORS = (TypeError, ValueError, RuntimeError, KeyError, IndexError, OverflowError)


def check_rng_state(rng: Any) -> None:
    """Raise `CorruptCheckpointError` unless `set_rng_state` can put back ``rng``.

    Each stream is tried on a throwaway generator (``random.Random``, NumPy's
    ``RandomState``, ``torch.Generator``), so no process-wide stream is touched: restore
    calls this before loading any live object, and verify calls it too, so both judge
    a checkpoint alike. CUDA states are checked for type only (trying one would need a
    CUDA context).
    """
    if not isinstance(rng, dict):
        raise CorruptCheckpointError(
            f"malformed RNG entry in checkpoint: a {type(rng).__name__}, not a dict"
        )
    try:
        if "python" in rng:
            random.Random().setstate(_python_state(rng["python"]))
        if "numpy" in rng:
            np.random.RandomState().set_state(rng["numpy"])
        if "torch_cpu" in rng:
            torch.Generator().set_state(_state_bytes(rng["torch_cpu"]))
        _cuda_states(rng)
    except _SETTER_ERRORS as exc:
        raise CorruptCheckpointError(f"malformed RNG state in checkpoint: {exc}") from exc


def set_rng_state(rng: Any, *, checked: bool = False) -> None:
    """Put back the process-wide random streams recorded by `rng_state`, checked by
    `check_rng_state` first (``checked``: the caller did that already, as `restore`
    does before it touches any live object)."""
    if not checked:
        check_rng_state(rng)
    if "python" in rng:
        random.setstate(_python_state(rng["python"]))
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "torch_cpu" in rng:
        torch.set_rng_state(_state_bytes(rng["torch_cpu"]))
    states = _cuda_states(rng)
    if states and torch.cuda.is_available():
        if len(states) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint holds RNG states for {len(states)} CUDA devices, this process "
                f"sees {torch.cuda.device_count()}; restoring the first ones only",
                RuntimeWarning,
                stacklevel=3,
            )
        try:
            for i, s in enumerate(states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        except RuntimeError as exc:
            raise CorruptCheckpointError(f"malformed CUDA RNG state in checkpoint: {exc}") from exc


def _python_state(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"Python's random state is a 3-tuple, found {str(value)[:80]}")
    version, internal, gauss = value
    if not isinstance(internal, (tuple, list)):
        raise TypeError("Python's random state holds a tuple of integers")
    return (version, tuple(internal), gauss)


def _state_bytes(value: Any) -> torch.Tensor:
    """A generator state as the fresh uint8 CPU tensor ``set_state`` needs (it crashes
    on views with a storage offset)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError(f"a generator state is a 1-D uint8 tensor, found {str(value)[:80]}")
    return value.detach().to("cpu").clone()


def _cuda_states(rng: dict[str, Any]) -> list[torch.Tensor]:
    states = rng.get("torch_cuda", [])
    if not isinstance(states, list):
        raise TypeError(f"CUDA RNG states are a list, found {type(states).__name__}")
    return [_state_bytes(t) for t in states]


class PythonState:
    """Python's global stream (``random.getstate()``), read anew only when it changed.

    ``random.getstate()`` builds a tuple of 625 new ints (~7 µs) that then has to be
    compared with the last one (~5 µs). The Mersenne Twister's position and 624 words
    lie in the ``_random.Random`` object's struct; where is found once on a private
    ``random.Random`` (its words and position searched for and checked after a draw and
    a reseed), then checked on ``random``'s own instance against ``getstate``; the
    kept Gaussian (``gauss_next``) is an attribute, compared by identity. Anything
    unexpected leaves this off: every call then reads ``getstate``. ``words_kept``
    says whether the last read found the words of the read before it (only the
    position moved): then the state is the last one with the position read, and
    ``getstate`` is not called."""

    _BYTES = 4 + 624 * 4  # the position (an int), then the words

    def __init__(self) -> None:
        self._inst: Any = None
        self._read: Callable[[], bytes] | None = None
        self._raw = b""
        self._gauss: Any = None
        self._last: Any = None
        self.words_kept = False

    def get(self) -> Any:
        inst: Any = getattr(random, "_inst", None)
        if inst is not self._inst:
            self._attach(inst)
        read = self._read
        if read is None:
            self.words_kept = False
            return random.getstate()
        raw = read()
        gauss = inst.gauss_next
        last = self._last
        if last is not None and raw == self._raw and gauss is self._gauss:
            return last
        self.words_kept = last is not None and raw[4:] == self._raw[4:]
        if self.words_kept:  # the same words: only the position (and Gaussian) to take
            position = int.from_bytes(raw[:4], sys.byteorder, signed=True)
            last = (last[0], (*last[1][:-1], position), gauss)
        else:
            last = random.getstate()
        self._raw, self._gauss, self._last = raw, gauss, last
        return last

    def _attach(self, inst: Any) -> None:
        self._inst, self._read, self._raw, self._gauss, self._last = inst, None, b"", None, None
        self.words_kept = False
        where = _python_offset()
        if where is None or not isinstance(inst, random.Random):
            return
        words = _memory_at(id(inst) + where, self._BYTES)

        def read() -> bytes:
            return words.raw

        if read() == _python_expected(random.getstate()):
            self._read = read


def _memory_at(address: int, size: int) -> Any:
    """The ``size`` bytes at ``address`` as a ctypes array that owns nothing: its ``raw``
    copies them out in C, without the foreign-function call a ``ctypes.string_at`` makes
    at every read (a cost that grows the longer a snapshot comes after the last one).
    It reads memory the caller keeps alive."""
    return (ctypes.c_char * size).from_address(address)


def _python_expected(state: Any) -> bytes:
    """What `PythonState` reads for ``random.getstate()``'s ``state``."""
    internal = state[1]
    return (
        int(internal[-1]).to_bytes(4, sys.byteorder, signed=True)
        + array.array("I", internal[:-1]).tobytes()
    )


@functools.lru_cache(maxsize=1)
def _python_offset() -> int | None:
    """Where a ``random.Random``'s position (then its words) lies in the object, found
    and checked on a private one; None if not found or not what ``getstate`` says."""
    if sys.implementation.name != "cpython" or array.array("I").itemsize != 4:
        return None
    try:
        import _random

        probe = random.Random(20261127)
        size = _random.Random.__basicsize__
        state = probe.getstate()
        raw = ctypes.string_at(id(probe), size)
        at = raw.find(_python_expected(state)[4:]) - 4
        if at < 0 or at + PythonState._BYTES > size:
            return None
        for change in (probe.random, lambda: probe.seed(7), lambda: probe.getrandbits(64)):
            change()
            got = ctypes.string_at(id(probe) + at, PythonState._BYTES)
            if got != _python_expected(probe.getstate()):
                return None
        return at
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


class NumpyState:
    """NumPy's global stream (``np.random.get_state(legacy=False)``), read anew only
    when it changed.

    Reading the state costs ~25 µs: NumPy copies the Mersenne Twister's 624 words one at
    a time into a new array. Comparing the state where it lies costs ~1 µs: the words
    and position at the bit generator's ``ctypes.state_address``, and the Gaussian the
    legacy generator keeps for its next ``normal()`` (``has_gauss``, ``gauss``: a
    normal drawn from it changes neither the words nor the position) in the generator
    object's own struct. That struct has no public address, so where it lies is found
    once on a private ``RandomState`` (the field that points at the generator's state,
    the field that points at that one, then the Gaussian beside it), checked there with
    a Gaussian pending and without, and checked again on NumPy's global generator
    against ``get_state``. Anything unexpected (another NumPy layout, another bit
    generator, another Python) leaves this off: every call then reads ``get_state``."""

    _STATE_BYTES = 624 * 4 + 4  # the words, then the position (an int)

    def __init__(self) -> None:
        self._gen: Any = None
        self._read: Callable[[], bytes] | None = None
        self._raw = b""
        self._last: dict[str, Any] | None = None
        self._keep: Any = None  # the object whose memory the read reads
        self._decode = False

    @property
    def kept(self) -> Any:
        """The state `get` returns while the stream does not change (or None)."""
        return self._last if self._read is not None else None

    def get(self) -> Any:
        rs = np.random.mtrand._rand
        gen = getattr(rs, "_bit_generator", None)
        if gen is not self._gen:
            self._attach(rs, gen)
        read = self._read
        if read is None:
            return np.random.get_state(legacy=False)
        raw = read()
        if raw == self._raw and self._last is not None:
            return self._last
        last = _decoded(raw) if self._decode else np.random.get_state(legacy=False)
        self._raw, self._last = raw, last
        return last

    def _attach(self, rs: Any, gen: Any) -> None:
        self._gen, self._read, self._raw, self._last = gen, None, b"", None
        where = _gaussian_offset()
        if where is None or type(gen).__name__ != "MT19937":
            return
        base = id(rs)
        try:
            address = int(gen.ctypes.state_address)
        except (AttributeError, TypeError, ValueError):
            return
        bit_off, gauss_off = where
        if _word(base + bit_off) != address or _word(base + gauss_off - 8) != base + bit_off:
            return
        words, gauss = _memory_at(address, self._STATE_BYTES), _memory_at(base + gauss_off, 16)

        def read() -> bytes:
            return words.raw + gauss.raw

        state = np.random.get_state(legacy=False)
        raw = read()
        if raw == _expected(state):
            self._read, self._keep = read, rs
            # the state made from the bytes read, where it is exactly get_state's
            self._decode = _same_state(_decoded(raw), state)


def _decoded(raw: bytes) -> dict[str, Any]:
    """``np.random.get_state(legacy=False)`` made from what `NumpyState` read (words,
    position, has_gauss, padding, gauss), without NumPy's element-by-element copy."""
    order = sys.byteorder
    words = NumpyState._STATE_BYTES - 4
    return {
        "bit_generator": "MT19937",
        "state": {
            "key": np.frombuffer(raw, dtype=np.uint32, count=words // 4).copy(),
            "pos": int.from_bytes(raw[words : words + 4], order, signed=True),
        },
        "has_gauss": int.from_bytes(raw[words + 4 : words + 8], order, signed=True),
        "gauss": struct.unpack("=d", raw[words + 12 : words + 20])[0],
    }


def _same_state(a: Any, b: Any) -> bool:
    """Whether two NumPy states are the same, key for key, type for type."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    return bool(a == b)


def _word(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


def _expected(state: dict[str, Any]) -> bytes:
    """What `NumpyState`'s read finds for ``state``: words, position, has_gauss, the
    4 bytes of padding after it (zero in a struct NumPy keeps zeroed), and gauss."""
    inner = state["state"]
    order = sys.byteorder
    return (
        np.asarray(inner["key"], dtype=np.uint32).tobytes()
        + int(inner["pos"]).to_bytes(4, order, signed=True)
        + int(state["has_gauss"]).to_bytes(4, order, signed=True)
        + bytes(4)
        + struct.pack("=d", float(state["gauss"]))
    )


@functools.lru_cache(maxsize=1)
def _gaussian_offset() -> tuple[int, int] | None:
    """(offset of the bit generator struct, offset of the Gaussian's ``has_gauss``) in a
    ``RandomState`` object of this NumPy, found and checked on a private one; None if
    they cannot be found or do not hold what ``get_state`` says."""
    if sys.implementation.name != "cpython" or struct.calcsize("P") != 8:
        return None
    try:
        probe = np.random.RandomState(20261127)
        base, size = id(probe), type(probe).__basicsize__
        address = int(probe._bit_generator.ctypes.state_address)
        words = [_word(base + off) for off in range(0, size - 7, 8)]
        bit_off = 8 * words.index(address)
        gauss_off = 8 * words.index(base + bit_off) + 8
        if gauss_off + 16 > size:
            return None
        for draw in (probe.standard_normal, probe.standard_normal, probe.random_sample):
            draw()  # a Gaussian pending, then used, then none after another draw
            state = probe.get_state(legacy=False)
            got = ctypes.string_at(address, NumpyState._STATE_BYTES) + ctypes.string_at(
                base + gauss_off, 16
            )
            if got != _expected(state):
                return None
        return bit_off, gauss_off
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
