"""PacTrain's pre-trained model file (paper 002, Alg. 1 "Data: Pre-trained model"; §III-B).

``--init FILE`` loads the flat parameters of a trained model from an ``.npz`` written by
:func:`save_init`; :func:`check_init_file` says what is wrong with a file before a run starts,
:func:`load_init` checks it against the model and loads it.
"""

from __future__ import annotations

import os
import zipfile
import zlib

import numpy as np

__all__ = ["INIT_FORMAT", "check_init_file", "load_init", "save_init"]


INIT_FORMAT = ("an .npz archive (numpy.savez) holding 'params', the model's flat parameter "
               "vector (one finite number per parameter), and 'buffer:NAME' for each of the "
               "model's buffers (BatchNorm running statistics), as "
               "dataparallel.pactrain.save_init(path, model) writes it")
#: the fix every refusal of ``--init`` ends with
_INIT_FIX = ("write it with dataparallel.pactrain.save_init(path, model) from a model of the "
             "same --model, --arch and --dataset")
#: the first bytes of a NumPy ``.npy`` file and of a zip archive (``.npz``)
_NPY_MAGIC, _ZIP_MAGIC = b"\x93NUMPY", b"PK"


def save_init(path, model) -> None:
    """Write ``model``'s flat parameters (key ``params``) and buffers (``buffer:NAME``) to
    ``path``, the ``.npz`` :data:`INIT_FORMAT` describes (for ``--init``)."""
    def host(a):
        return a.get() if hasattr(a, "get") else np.asarray(a)
    np.savez(path, params=host(model.params.flat),
             **{f"buffer:{k}": host(v) for k, v in model.buffers.items()})


def check_init_file(path) -> list[str]:
    """The names in the ``--init`` archive ``path``, reading only its directory (a cheap check
    before a run starts; :func:`load_init` reads and checks the arrays).

    Raises
    ------
    ValueError
        Naming ``--init``, the file, what is wrong (missing, a directory, an ``.npy`` array,
        not a zip archive, damaged, no ``params``) and the fix.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        raise ValueError(f"--init {p} is a directory: pass the .npz file ({INIT_FORMAT})")
    try:
        with open(p, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    except FileNotFoundError:
        raise ValueError(f"--init {p}: no such file; {_INIT_FIX}") from None
    except OSError as exc:
        raise ValueError(f"--init {p} cannot be read ({exc.strerror or exc})") from None
    if head.startswith(_NPY_MAGIC):
        raise ValueError(f"--init {p} is a single .npy array, not an .npz archive: --init reads "
                         f"{INIT_FORMAT}; for a bare parameter vector write "
                         "numpy.savez(path, params=vector) (a model with BatchNorm also needs "
                         "its buffers: use save_init)")
    if not head.startswith(_ZIP_MAGIC):
        raise ValueError(f"--init {p} is not an .npz archive (it does not start like a zip "
                         f"file): --init reads {INIT_FORMAT}")
    try:
        with np.load(p, allow_pickle=False) as f:
            names = list(f.files)
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"--init {p} is not a readable .npz ({type(exc).__name__}: {exc}); "
                         f"pass a complete file: {_INIT_FIX}") from None
    if "params" not in names:
        raise ValueError(f"--init {p}: no 'params' array (the flat parameter vector; the file "
                         f"holds {', '.join(names) or 'nothing'}); {_INIT_FIX}")
    return names


def _read_init(path) -> dict:
    """Every array of an ``--init`` file (a damaged file is a ``ValueError`` naming it)."""
    check_init_file(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        raise ValueError(f"--init {path} is not a readable .npz ({type(exc).__name__}: {exc}); "
                         f"pass a complete file: {_INIT_FIX}") from None


def _check_init_array(path, key: str, a: np.ndarray, shape: tuple, where=None) -> None:
    """``a`` (entry ``key`` of ``--init path``) has ``shape``, real numbers, all finite."""
    if a.shape != shape:
        raise ValueError(f"--init {path}: '{key}' has shape {a.shape} but the model needs "
                         f"{shape}; {_INIT_FIX}")
    if a.dtype.kind not in "fiu":
        raise ValueError(f"--init {path}: '{key}' holds {a.dtype} values, not real numbers; "
                         f"{_INIT_FIX}")
    bad = np.flatnonzero(~np.isfinite(a.reshape(-1))) if a.dtype.kind == "f" else ()
    if len(bad):
        at = where(int(bad[0])) if where is not None else f"index {int(bad[0])}"
        raise ValueError(f"--init {path}: '{key}' holds {len(bad)} non-finite value(s) (NaN or "
                         f"Inf; the first at {at}): a run cannot start from it; save a model "
                         "whose weights are finite (a run that did not diverge) with "
                         "dataparallel.pactrain.save_init(path, model)")


def load_init(path, model) -> None:
    """Load an ``.npz`` of :func:`save_init` into ``model`` (in place; every rank loads the same
    file, so every rank starts from the same model).

    Raises
    ------
    ValueError
        Naming ``--init``, the file and the fix, for anything but :data:`INIT_FORMAT` for this
        model: not an ``.npz``, damaged, ``params`` missing, of another size, not real numbers
        or not finite, a buffer missing, of another shape or unknown to the model.
    """
    f = _read_init(path)
    layout = model.layout
    names = list(layout.names)

    def tensor_at(i: int) -> str:
        name = max((n for n in names if layout.offsets[n] <= i), key=layout.offsets.get)
        return f"parameter {i}, tensor {name!r}"

    _check_init_array(path, "params", f["params"], (layout.total,), tensor_at)
    wanted = {f"buffer:{k}": v for k, v in model.buffers.items()}
    unknown = sorted(k for k in f if k != "params" and k not in wanted)
    if unknown:
        raise ValueError(f"--init {path}: {', '.join(repr(k) for k in unknown)} not a buffer of "
                         f"this model (its buffers: {', '.join(wanted) or 'none'}); {_INIT_FIX}")
    missing = [k for k in wanted if k not in f]
    if missing:
        raise ValueError(f"--init {path}: no {', '.join(repr(k) for k in missing)} (the model's "
                         f"running statistics); {_INIT_FIX}")
    for key, buf in wanted.items():
        _check_init_array(path, key, f[key], tuple(buf.shape))
    model.params.flat[...] = model.xp.asarray(f["params"], dtype=model.params.flat.dtype)
    for key, buf in wanted.items():
        buf[...] = model.xp.asarray(f[key], dtype=buf.dtype)
