"""``cupy.random`` of the strict stand-in.

Its bit streams deliberately differ from NumPy's for the same seed (as CuPy's do): code that
needs the CPU and GPU runs to draw the same numbers must draw them on the host.
"""

from __future__ import annotations

import numpy as _np

from . import _core

_SALT = 0x5EED_C0DE


def _salted(seed):
    if seed is None:
        return None
    return [_SALT, *(_np.atleast_1d(_np.asarray(seed, dtype=_np.uint64)).tolist())]


class _Wrapped:
    def __init__(self, gen) -> None:
        self._g = gen

    def __getattr__(self, name):
        fn = getattr(self._g, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            args = _core._unwrap(args, [])
            kwargs = _core._unwrap(kwargs, [])
            res = fn(*args, **kwargs)
            out = _core._wrap(res)
            if isinstance(out, _core.ndarray):
                _core._stamp_write([out])
            return out
        return call


class RandomState(_Wrapped):
    def __init__(self, seed=None) -> None:
        super().__init__(_np.random.RandomState(None if seed is None else
                                                _np.random.SeedSequence(_salted(seed))
                                                .generate_state(1)[0]))


class Generator(_Wrapped):
    pass


def default_rng(seed=None) -> Generator:
    return Generator(_np.random.default_rng(_salted(seed)))


_global = RandomState()


def seed(s=None) -> None:
    global _global
    _global = RandomState(s)


def get_random_state() -> RandomState:
    return _global


def __getattr__(name):
    return getattr(_global, name)
