"""An embedded byte-level text corpus (no download) for the small language model.

The corpus is the English text of Python's own documentation topics (``pydoc_data.topics``,
shipped with every CPython: about 466 KB of UTF-8 text), joined in sorted key order with blank
lines between topics, encoded to bytes.  Tokens are the 256 byte values.

Split: the first ``1 - heldout_fraction`` of the byte stream is the training text, the rest the
held-out text (contiguous, so no window straddles both).  Each split is cut into windows of
``context`` tokens starting every ``stride`` bytes; a sample is

* ``x``: the window ``c[s : s + T]`` (``(T,)`` int64 byte ids),
* ``y``: the next byte ``c[s + T]`` (the label).

A causal language model trains on all ``T`` next-byte targets ``c[s+1 : s+T+1]`` (the window
shifted by one, completed by ``y``; :meth:`models.transformer.TransformerModel.lm_loss`); code
written for classifiers sees an ordinary :class:`~models.data.Dataset` with ``num_classes = 256``
and scores next-byte prediction.

:func:`unigram_entropy` is the reference the language model must beat: the entropy (nats per
byte) of the training text's byte frequencies, i.e. the held-out loss of the best model that
ignores context.
"""

from __future__ import annotations

import numpy as np

from .data import Dataset, DatasetSplit

__all__ = [
    "TEXT_DATASETS",
    "VOCAB",
    "corpus_bytes",
    "cross_entropy_under",
    "load_text",
    "text_windows",
    "unigram_entropy",
]

#: byte-level vocabulary size
VOCAB = 256


def corpus_bytes() -> np.ndarray:
    """The whole corpus as a ``uint8`` array (deterministic: topics in sorted key order)."""
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - every CPython ships it
        raise ValueError("the 'text' dataset needs the standard library's pydoc_data.topics "
                         "module, which this Python lacks; use a full CPython build") from exc
    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def text_windows(stream: np.ndarray, context: int, stride: int | None = None,
                 name: str = "text") -> Dataset:
    """Windows ``x = c[s:s+T]`` with labels ``y = c[s+T]``, ``s = 0, stride, 2 stride, ...``.

    Parameters
    ----------
    stream : 1-D integer array of byte ids
    context : int
        Window length ``T``.
    stride : int, optional
        Distance between window starts (default ``context``: windows tile the text).
    """
    T = int(context)
    stride = T if stride is None else int(stride)
    if T < 1 or stride < 1:
        raise ValueError(f"context and stride must be >= 1, got {context}, {stride}")
    stream = np.asarray(stream)
    if stream.ndim != 1 or stream.size < T + 1:
        raise ValueError(f"{name}: need a 1-D stream of at least context + 1 = {T + 1} tokens, "
                         f"got shape {stream.shape}; use a smaller --arch context")
    starts = np.arange(0, stream.size - T, stride)
    x = stream[starts[:, None] + np.arange(T)].astype(np.int64)
    y = stream[starts + T].astype(np.int64)
    return Dataset(x, y, VOCAB, name)


def load_text(root=None, *, context: int = 64, stride: int | None = None,
              heldout_fraction: float = 0.1) -> DatasetSplit:
    """Train / held-out windows of the embedded corpus (see the module docstring).

    ``root`` is ignored (the corpus is embedded); it is accepted so the loader has the
    signature of :data:`models.data.DATASETS` entries.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    c = corpus_bytes()
    cut = int(round(c.size * (1 - heldout_fraction)))
    return DatasetSplit(text_windows(c[:cut], context, stride, "text"),
                        text_windows(c[cut:], context, context, "text"))


def _frequencies(stream: np.ndarray) -> np.ndarray:
    return np.bincount(np.asarray(stream, dtype=np.int64), minlength=VOCAB).astype(np.float64)


def unigram_entropy(stream: np.ndarray | None = None) -> float:
    """``H = -Σ_b p_b ln p_b`` (nats per byte) of the byte frequencies of ``stream`` (default:
    the training text of :func:`load_text`)."""
    if stream is None:
        c = corpus_bytes()
        stream = c[:int(round(c.size * 0.9))]
    p = _frequencies(stream)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def cross_entropy_under(train_stream: np.ndarray, test_stream: np.ndarray,
                        alpha: float = 1.0) -> float:
    """Held-out loss (nats per byte) of the unigram model fitted on ``train_stream`` with
    add-``alpha`` smoothing: what a context-free predictor scores on ``test_stream``."""
    counts = _frequencies(train_stream) + alpha
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(test_stream, dtype=np.int64)].mean())


#: ``--dataset`` name -> loader, in the signature of :data:`models.data.DATASETS`
TEXT_DATASETS = {"text": load_text}

