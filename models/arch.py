"""``--arch KEY=VALUE``: the model factory arguments every training command takes, declared once.

:data:`ARCH` lists, per ``--model``, every key its factory in :data:`models.zoo.MODELS` takes
(besides ``xp``, ``dtype``, ``seed``), with its type and its allowed range; the defaults are
read from the factory's own signature, and a key declared here that the signature lacks (or
the other way round) fails at import and in the tests, so the table and the factories cannot
drift apart.  :data:`DATA_KEYS` lists the keys a dataset reads (``context``: the window of the
byte ``text`` dataset).  :data:`DATA_INPUTS` says what each ``--dataset`` feeds a model (images
of a known shape, or byte windows), so every check runs before a run starts, without loading
data.

:func:`parse_arch` turns the ``--arch`` items into typed values and checks

* the key: known for the model (or read by the dataset);
* the type: whole number, number, one of a few words, true/false, or comma-separated whole
  numbers (``--arch hidden=1024,1024``);
* the range of every value;
* the combinations: ``heads`` divides the width, ``patch`` divides the images, the
  feed-forward width ``round(dim * mlp_ratio)`` is at least 1, ResNet ``depths`` and
  ``planes`` name the same stages, the text window fits the held-out text;

and :func:`check_model_dataset` that the model reads what the dataset holds.  Every refusal is
one ``ValueError`` naming ``--arch KEY``, the value given, what is allowed and an example.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from functools import lru_cache

from .text import corpus_bytes, load_text
from .zoo import MODELS

__all__ = ["ARCH", "DATA_INPUTS", "DATA_KEYS", "ArchKey", "arch_help", "check_model_dataset",
           "parse_arch", "split_arch"]

#: largest width (channels, hidden units, model width) a key accepts
MAX_WIDTH = 65536
#: largest depth (blocks, stages) a key accepts
MAX_DEPTH = 1024
#: largest feed-forward ratio of the transformers
MAX_RATIO = 64.0
#: the factory parameters that are not model shape (set by the trainers, not by ``--arch``)
NOT_ARCH = ("xp", "dtype", "seed")
#: spellings of true and false
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class ArchKey:
    """One ``--arch`` key.

    Attributes
    ----------
    name : str
    kind : {"int", "float", "choice", "bool", "ints"}
        ``ints``: comma-separated whole numbers; one number without a comma stays a number
        (the factories read it as one stage or one layer, ResNet ``depths`` as every stage).
    help : str
        What it sets (for messages and ``--help``).
    example : str
        A value that works with the defaults (the ``e.g.`` of every message).
    lo, hi : float
        Inclusive range of every number (``float``: ``lo`` is excluded).
    choices : tuple of str
        The words of a ``choice`` key.
    length : int or None
        The number of values an ``ints`` key needs (``None``: any, at least ``min_len``).
    min_len : int
        The fewest values of an ``ints`` key (0: an empty list is allowed).
    """

    name: str
    kind: str
    help: str
    example: str
    lo: float = 1
    hi: float = MAX_WIDTH
    choices: tuple = ()
    length: int | None = None
    min_len: int = 1

    def allowed(self) -> str:
        """The allowed values, in words."""
        if self.kind == "int":
            return f"a whole number from {self.lo:g} to {self.hi:g}"
        if self.kind == "float":
            return f"a number > {self.lo:g} and <= {self.hi:g}"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "true or false"
        count = (f"{self.length} comma-separated" if self.length is not None else
                 "comma-separated" if self.min_len else "none or comma-separated")
        return f"{count} whole numbers from {self.lo:g} to {self.hi:g}"

    def parse(self, raw: str, owner: str = ""):
        """The typed value of ``raw`` (a ``ValueError`` naming the key, and ``owner``, e.g.
        ``"--model vit"``, when it is malformed or out of range)."""
        text = raw.strip()
        if self.kind == "int":
            return self.check(self._int(text, raw, owner), raw, owner)
        if self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise self.error(raw, owner) from None
            return self.check(value, raw, owner)
        if self.kind == "choice":
            return self.check(text, raw, owner)
        if self.kind == "bool":
            if text.lower() not in _TRUE + _FALSE:
                raise self.error(raw, owner)
            return text.lower() in _TRUE
        parts = [p.strip() for p in text.split(",")] if text else []
        if "," in text and not parts[-1]:
            parts.pop()                       # a trailing comma: "16," is one stage
        values = tuple(self._int(p, raw, owner) for p in parts)
        return self.check(values[0] if "," not in text and len(values) == 1 else values, raw,
                          owner)

    def _int(self, text: str, raw: str, owner: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise self.error(raw, owner) from None

    def check(self, value, raw=None, owner: str = ""):
        """``value`` (typed: what :meth:`parse` returns, or a library caller's value) if it is
        of this key's type and in range; else a ``ValueError`` naming the key."""
        raw = value if raw is None else raw
        if self.kind == "int":
            ok = _is_int(value) and self.lo <= value <= self.hi
        elif self.kind == "float":
            ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value) \
                and self.lo < value <= self.hi
        elif self.kind == "choice":
            ok = value in self.choices
        elif self.kind == "bool":
            ok = isinstance(value, bool)
        else:
            seq = (value,) if _is_int(value) else value
            ok = isinstance(seq, (tuple, list)) and all(_is_int(v) and self.lo <= v <= self.hi
                                                        for v in seq) \
                and (len(seq) == self.length if self.length is not None
                     else len(seq) >= self.min_len)
            if ok and not _is_int(value):
                value = tuple(int(v) for v in value)
        if not ok:
            raise self.error(raw, owner)
        return value

    def error(self, raw, owner: str = "") -> ValueError:
        """The refusal of ``raw``: the key, what it sets, what is allowed, an example."""
        shown = _show(raw)
        of = f" of {owner}" if owner else ""
        return ValueError(f"--arch {self.name}={shown}: {self.name}{of} ({self.help}) must be "
                          f"{self.allowed()}, got {shown!r}; e.g. --arch "
                          f"{self.name}={self.example}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(value) -> str:
    """A typed value as it would be written on the command line."""
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


_INIT = ArchKey("init", "choice", "initial weights: gpt2 = N(0, 0.02^2) with scaled residual "
                "projections, he = He-normal", "he", choices=("gpt2", "he"))
_DIM = ArchKey("dim", "int", "the transformer's width", "32")
_DEPTH = ArchKey("depth", "int", "transformer blocks", "2", hi=MAX_DEPTH)
_HEADS = ArchKey("heads", "int", "attention heads; they divide dim", "2")

#: ``--model`` -> its ``--arch`` keys (the factory's keyword arguments, defaults from the
#: factory's signature)
ARCH: dict[str, dict[str, ArchKey]] = {m: {k.name: k for k in keys} for m, keys in {
    "mlp": (ArchKey("hidden", "ints", "hidden widths, one per hidden layer (none: a linear "
                    "classifier)", "1024,1024", min_len=0),),
    "cnn": (ArchKey("channels", "ints", "output channels of the two convolutions", "16,32",
                    length=2),
            ArchKey("hidden", "int", "width of the hidden fully connected layer", "128")),
    "resnet": (ArchKey("block", "choice", "residual block", "bottleneck",
                       choices=("basic", "bottleneck")),
               ArchKey("depths", "ints", "blocks per stage (one number: every stage)",
                       "2,2,2", hi=MAX_DEPTH),
               ArchKey("planes", "ints", "planes per stage", "16,32,64"),
               ArchKey("stem_channels", "int", "output channels of the stem convolution "
                       "(default: the first stage's planes)", "16"),
               ArchKey("base_width", "int", "bottleneck inner width = planes * base_width / 64",
                       "128")),
    "vit": (ArchKey("patch", "int", "side of the square image patches; it divides the image",
                    "2", hi=4096),
            _DIM, _DEPTH, _HEADS,
            ArchKey("mlp_ratio", "float", "feed-forward width / dim", "1.5", lo=0,
                    hi=MAX_RATIO),
            ArchKey("pool", "choice", "the token the head reads: the class token, the mean or "
                    "the last token", "mean", choices=("cls", "mean", "last")),
            _INIT),
    "gpt": (_DIM, _DEPTH, _HEADS,
            ArchKey("mlp_ratio", "float", "feed-forward width / dim", "2", lo=0, hi=MAX_RATIO),
            ArchKey("tie", "bool", "the output head shares the token embedding", "true"),
            _INIT),
}.items()}


@lru_cache(maxsize=1)
def _text_context_max() -> int:
    """The longest window of the ``text`` dataset: one less than its held-out bytes (the split
    of :func:`models.text.load_text`)."""
    n = corpus_bytes().size
    held = inspect.signature(load_text).parameters["heldout_fraction"].default
    return n - round(n * (1 - held)) - 1


#: ``--dataset`` -> the keys it reads from ``--arch`` (``hi`` of ``context``: filled in when
#: checked, from the corpus)
DATA_KEYS: dict[str, dict[str, ArchKey]] = {
    "text": {"context": ArchKey("context", "int", "the byte window of --dataset text, in "
                                "tokens", "32", hi=MAX_WIDTH)},
}

#: ``--dataset`` -> what it feeds a model: ``("images", (C, H, W))`` or ``("tokens", None)``
DATA_INPUTS: dict[str, tuple[str, tuple | None]] = {
    "digits": ("images", (1, 8, 8)), "synthetic": ("images", (1, 8, 8)),
    "mnist": ("images", (1, 28, 28)), "cifar10": ("images", (3, 32, 32)),
    "text": ("tokens", None),
}
#: ``--model`` -> the inputs it reads (``mlp`` flattens whatever it is given)
MODEL_INPUTS = {"mlp": ("images", "tokens"), "cnn": ("images",), "resnet": ("images",),
                "vit": ("images",), "gpt": ("tokens",)}


def _defaults(model: str) -> dict:
    """The factory's keyword defaults of ``model`` (its ``--arch`` keys)."""
    params = inspect.signature(MODELS[model]).parameters
    return {k: p.default for k, p in params.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and k not in NOT_ARCH}


def _check_table() -> None:
    """The keys of :data:`ARCH` are exactly the factories' keyword arguments."""
    for model in MODELS:
        have, want = set(ARCH.get(model, {})), set(_defaults(model))
        if have != want:
            raise RuntimeError(f"models/arch.py: --arch keys of {model} {sorted(have)} differ "
                               f"from its factory's keyword arguments {sorted(want)}; declare "
                               "every factory argument in ARCH")


_check_table()


def arch_help() -> str:
    """One line per model listing its keys (for ``--help``)."""
    return "; ".join(f"{m}: {', '.join(keys)}" for m, keys in ARCH.items()) + \
        "; --dataset text: context"


def check_model_dataset(model: str, dataset: str) -> None:
    """Refuse a model that cannot read the dataset (``ValueError`` naming both and the fix)."""
    if model not in MODELS:
        raise ValueError(f"unknown --model {model!r}; valid: {', '.join(sorted(MODELS))}")
    if dataset not in DATA_INPUTS:
        raise ValueError(f"unknown --dataset {dataset!r}; valid: "
                         f"{', '.join(sorted(DATA_INPUTS))}")
    kind = DATA_INPUTS[dataset][0]
    if kind in MODEL_INPUTS[model]:
        return
    fits = sorted(m for m, kinds in MODEL_INPUTS.items() if kind in kinds)
    sets = sorted(d for d, (k, _) in DATA_INPUTS.items() if k in MODEL_INPUTS[model])
    what = {"images": "images (C, H, W)", "tokens": "byte windows (T,)"}
    raise ValueError(f"--model {model} reads {what[MODEL_INPUTS[model][0]]} and --dataset "
                     f"{dataset} holds {what[kind]}: use --dataset {' / '.join(sets)} with "
                     f"--model {model}, or --model {' / '.join(fits)} with --dataset {dataset}")


def _unknown(key: str, raw, model: str, dataset: str) -> ValueError:
    keys = list(ARCH[model]) + list(DATA_KEYS.get(dataset, {}))
    first = ARCH[model][next(iter(ARCH[model]))]
    readers = [d for d, k in DATA_KEYS.items() if key in k]
    where = (f"{key} is read by --dataset {', '.join(readers)}, not by --dataset {dataset}; "
             if readers else "")
    return ValueError(f"--arch {key}={_show(raw)}: {where}--model {model} has no key {key!r} "
                      f"(its keys with --dataset {dataset}: {', '.join(keys)}); e.g. --arch "
                      f"{first.name}={first.example}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _near(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` not above ``at_most`` (1 at least)."""
    return max(d for d in _divisors(n) if d <= max(at_most, 1))


def _listed(values) -> str:
    return ", ".join(map(str, values))


def _check_combinations(model: str, dataset: str, given: dict, raw: dict) -> None:
    """The checks that read more than one value (``given``: the typed values passed, ``raw``:
    as they were written)."""
    v = {**_defaults(model), **given}

    def said(key: str) -> str:
        return raw.get(key, _show(v[key]))

    shape = DATA_INPUTS[dataset][1]
    if model in ("vit", "gpt"):
        dim, heads = v["dim"], v["heads"]
        if dim % heads:
            key = "heads" if "heads" in given or "dim" not in given else "dim"
            raise ValueError(f"--arch {key}={said(key)}: heads={heads} must divide the width "
                             f"dim={dim} of --model {model} (each head reads dim / heads "
                             f"features): e.g. --arch heads={_near(dim, heads)} (divisors of "
                             f"{dim}: {_listed(_divisors(dim))})")
        if round(dim * v["mlp_ratio"]) < 1:
            raise ValueError(f"--arch mlp_ratio={said('mlp_ratio')}: the feed-forward width "
                             f"round(dim * mlp_ratio) = round({dim} * {v['mlp_ratio']}) is 0; it "
                             f"must be at least 1: e.g. --arch mlp_ratio=1.5")
    if model == "vit" and shape is not None:
        p, (_, H, W) = v["patch"], shape
        if H % p or W % p:
            common = math.gcd(H, W)
            raise ValueError(f"--arch patch={said('patch')}: the patch side must divide the {H}x{W} images "
                             f"of --dataset {dataset}: e.g. --arch patch={_near(common, p)} "
                             f"(divisors: {_listed(_divisors(common))})")
    if model == "resnet":
        depths, planes = v["depths"], v["planes"]
        planes = (planes,) if isinstance(planes, int) else tuple(planes)
        if not isinstance(depths, int) and len(depths) != len(planes):
            key = "planes" if "planes" in given and "depths" not in given else "depths"
            raise ValueError(f"--arch {key}={said(key)}: depths={said('depths')} names "
                             f"{len(depths)} stage(s) and planes={said('planes')} "
                             f"{len(planes)}: give one depth per stage (e.g. --arch depths="
                             f"{','.join(['2'] * len(planes))}) or one number for every stage "
                             "(--arch depths=2)")
        if v["block"] == "bottleneck":
            narrow = [p for p in planes if p * v["base_width"] // 64 < 1]
            if narrow:
                raise ValueError(f"--arch base_width={said('base_width')}: the bottleneck inner "
                                 f"width planes * base_width / 64 is 0 for planes {narrow[0]}; "
                                 "e.g. --arch base_width=64")


def parse_arch(items, model: str, dataset: str = "digits") -> tuple:
    """The ``--arch`` items of ``model`` on ``dataset``, typed and checked.

    Parameters
    ----------
    items : iterable of str or (key, value) pairs, or None
        ``"KEY=VALUE"`` strings as given on the command line, or ``(key, value)`` pairs of
        typed values (:class:`models.train.TrainConfig`'s ``arch``), or a mix.
    model, dataset : str

    Returns
    -------
    tuple of (key, value) pairs, in the order given (a key given twice: the last one).

    Raises
    ------
    ValueError
        One line naming ``--arch KEY``, the value, what is allowed and an example; or naming
        ``--model`` / ``--dataset`` when the model cannot read the dataset.
    """
    check_model_dataset(model, dataset)
    keys = {**ARCH[model], **_data_keys(dataset)}
    typed: dict = {}
    raw: dict = {}
    for item in items or ():
        if isinstance(item, str):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key:
                first = next(iter(ARCH[model].values()))
                raise ValueError(f"--arch takes KEY=VALUE, got {item!r}; e.g. --arch "
                                 f"{first.name}={first.example}")
            if key not in keys:
                raise _unknown(key, value, model, dataset)
            typed[key] = keys[key].parse(value, _owner(key, model, dataset))
            raw[key] = value.strip()
        else:
            key, value = item
            if key not in keys:
                raise _unknown(key, value, model, dataset)
            typed[key] = keys[key].check(value, owner=_owner(key, model, dataset))
            raw[key] = _show(value)
    _check_combinations(model, dataset, {k: v for k, v in typed.items() if k in ARCH[model]},
                        raw)
    return tuple(typed.items())


def _owner(key: str, model: str, dataset: str) -> str:
    return f"--model {model}" if key in ARCH[model] else f"--dataset {dataset}"


def _data_keys(dataset: str) -> dict[str, ArchKey]:
    keys = dict(DATA_KEYS.get(dataset, {}))
    if "context" in keys:
        keys["context"] = replace(keys["context"], hi=_text_context_max())
    return keys


def split_arch(arch, model: str, dataset: str) -> tuple[dict, dict]:
    """``(factory keyword arguments, dataset keyword arguments)`` of checked ``arch`` pairs
    (:func:`parse_arch`)."""
    pairs = parse_arch(arch, model, dataset)
    return ({k: v for k, v in pairs if k in ARCH[model]},
            {k: v for k, v in pairs if k not in ARCH[model]})
