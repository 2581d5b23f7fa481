"""``cupyx.scipy.sparse`` of the strict stand-in: CSR/CSC matrices on the device with int32
indices (as cuSPARSE), products with dense device matrices, explicit ``get()`` to SciPy."""

from __future__ import annotations

import numpy as _np
import scipy.sparse as _sp
from cupy import _core


def issparse(x) -> bool:
    return isinstance(x, _compressed)


class _compressed(_core._SparseBase):
    _format = "csr"

    def __init__(self, arg1, shape=None, dtype=None, copy=False) -> None:
        if _sp.issparse(arg1):
            m = arg1.asformat(self._format)
            data, indices, indptr = (_core._convert("asarray", _np.asarray)(v)
                                     for v in (m.data, m.indices, m.indptr))
            shape = m.shape
        elif isinstance(arg1, tuple) and len(arg1) == 3:
            data, indices, indptr = arg1
            for v in (data, indices, indptr):
                if not isinstance(v, _core.ndarray):
                    raise TypeError(f"{type(self).__name__}((data, indices, indptr)) takes "
                                    "device arrays; move them with cupy.asarray first")
            if shape is None:
                raise ValueError("shape is required")
        elif isinstance(arg1, _compressed):
            data, indices, indptr, shape = arg1.data, arg1.indices, arg1.indptr, arg1.shape
        else:
            raise TypeError(f"unsupported {type(self).__name__} argument {type(arg1)}")
        if dtype is not None:
            data = data.astype(dtype, copy=False)
        self.data = data.copy() if copy else data
        self.indices = indices.astype(_np.int32, copy=False)
        self.indptr = indptr.astype(_np.int32, copy=False)
        self._shape = tuple(int(s) for s in shape)

    shape = property(lambda s: s._shape)
    dtype = property(lambda s: s.data.dtype)
    ndim = 2
    format = property(lambda s: s._format)

    @property
    def nnz(self) -> int:
        return int(self.data.size)

    def _host(self):
        cls = _sp.csr_matrix if self._format == "csr" else _sp.csc_matrix
        return cls((self.data._a, self.indices._a, self.indptr._a), shape=self._shape,
                   copy=False)

    def get(self, stream=None):
        _core.counter.sync("sparse.get")
        return self._host().copy()

    def __matmul__(self, other):
        if isinstance(other, _core.ndarray):
            _core._check_device([self.data, other])
            _core._order_before_op(_core.get_current_stream())
            out = _core._wrap(_np.asarray(self._host() @ other._a))
            _core._stamp_write([out])
            return out
        if isinstance(other, _np.ndarray):
            raise TypeError(_core._REFUSE_NUMPY)
        return NotImplemented

    dot = __matmul__

    def __rmatmul__(self, other):
        return NotImplemented

    @property
    def T(self):
        return self.transpose()

    def transpose(self, axes=None, copy=False):
        other = csc_matrix if self._format == "csr" else csr_matrix
        t = other.__new__(other)
        t.data, t.indices, t.indptr = self.data, self.indices, self.indptr
        t._shape = self._shape[::-1]
        return t

    def tocsr(self):
        if self._format == "csr":
            return self
        return csr_matrix(self.get())

    def sum(self, axis=None):
        return _core._wrap(_np.asarray(self._host().sum(axis=axis)))

    def __repr__(self) -> str:
        return f"<strictcupy {self._format} {self._shape} nnz={self.nnz}>"


class csr_matrix(_compressed):
    _format = "csr"


class csc_matrix(_compressed):
    _format = "csc"


spmatrix = _compressed
