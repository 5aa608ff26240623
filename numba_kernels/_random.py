"""Counter-based random numbers shared by the CPU and CUDA kernels.

Every random draw is a pure function of ``(key, index)``:

    z  = key + (index + 1) * GAMMA          (mod 2**64)
    z  = (z ^ (z >> 30)) * M1
    z  = (z ^ (z >> 27)) * M2
    h  = z ^ (z >> 31)                      -> 64-bit hash
    u  = (h >> 40) * 2**-24                 -> float32 uniform in [0, 1)

i.e. element ``index`` of a SplitMix64 stream started at ``key``.  ``key`` is
derived from the user's integer ``seed`` on the host with :func:`seed_key`
(one SplitMix64 finalisation of the seed, so nearby seeds give unrelated
streams).  The per-element functions below use only 64-bit integer operations
plus one exact integer->float32 conversion, so a numba CPU kernel and a numba
CUDA kernel produce bit-identical numbers for the same (seed, index), no matter
how the work is split between threads.

Seeding convention for callers: derive a fresh seed per step and per tensor,
e.g. ``derive_seed(base_seed, step, tensor_id)``.  Workers that must agree on
a random choice (random-k sparsification) pass the same seed; workers that
must be independent (stochastic quantisation) mix in their rank.

The plain-Python bodies (``*_py``) are compiled twice: with ``numba.njit`` here
and with ``numba.cuda.jit(device=True)`` in :mod:`numba_kernels._cuda`.  They
are deliberately self-contained (no calls to other helpers) so that the same
source compiles for both targets.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_MASK64 = (1 << 64) - 1
_GAMMA_INT = 0x9E3779B97F4A7C15
_M1_INT = 0xBF58476D1CE4E5B9
_M2_INT = 0x94D049BB133111EB

# numba freezes module globals as typed constants; keep them all uint64 so no
# uint64/int64 mixing (which numba would promote to float64) can happen.
_GAMMA = np.uint64(_GAMMA_INT)
_M1 = np.uint64(_M1_INT)
_M2 = np.uint64(_M2_INT)
_ONE = np.uint64(1)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)
_S40 = np.uint64(40)
_INV24 = np.float32(1.0 / 16777216.0)  # 2**-24, exact

#: key used for deterministic, seed-independent sampling (top-k threshold).
SAMPLE_KEY = np.uint64(0x5EED_70F4_C0FF_EE01)


def _mix64_int(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1_INT) & _MASK64
    z = ((z ^ (z >> 27)) * _M2_INT) & _MASK64
    return z ^ (z >> 31)


def seed_key(seed: int) -> np.uint64:
    """Host side: map any Python int ``seed`` to the uint64 stream key."""
    return np.uint64(_mix64_int((int(seed) + _GAMMA_INT) & _MASK64))


def derive_seed(*parts: int) -> int:
    """Combine integers (base seed, step, tensor id, rank, ...) into one seed.

    Order matters; the result is a non-negative int < 2**64 suitable for the
    ``seed`` argument of the kernels.
    """
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _mix64_int(h ^ _mix64_int((int(p) + _GAMMA_INT) & _MASK64))
    return h


def hash64_py(key, idx):
    """64-bit hash of element ``idx`` of the stream ``key`` (both -> uint64)."""
    z = key + (np.uint64(idx) + _ONE) * _GAMMA
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def uniform_py(key, idx):
    """float32 uniform in [0, 1) with 24 random bits (top bits of hash64)."""
    z = key + (np.uint64(idx) + _ONE) * _GAMMA
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z = z ^ (z >> _S31)
    return np.float32(z >> _S40) * _INV24


hash64 = njit(cache=True, inline="always")(hash64_py)
uniform = njit(cache=True, inline="always")(uniform_py)

