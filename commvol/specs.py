"""Model names a prediction accepts: shape specs, their aliases and the trainable models.

Imports only :mod:`models`, so every ``commvol`` module (the per-system glue included) can
resolve a ``--model`` name without importing another ``commvol`` module.
"""

from __future__ import annotations

import numpy as np

from models import MODELS, SPECS, build_model, get_spec, resnet

__all__ = [
    "DATASET_SHAPES",
    "MODEL_ALIASES",
    "SPEC_ARCH",
    "build_trainable",
    "model_names",
    "resolve_model",
]

#: other spellings of the spec names
MODEL_ALIASES = {"wrn50_2": "wide_resnet50_2", "wrn-50-2": "wide_resnet50_2",
                 "wideresnet50_2": "wide_resnet50_2", "resnet-18": "resnet18",
                 "resnet-152": "resnet152"}

#: ``(input_shape, num_classes)`` of the trainers' datasets (checked against
#: :func:`models.load_dataset` in the tests)
DATASET_SHAPES = {"digits": ((1, 8, 8), 10), "synthetic": ((1, 8, 8), 10),
                  "mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10),
                  "text": ((64,), 256)}


def model_names() -> list[str]:
    """Every valid ``--model`` name."""
    return sorted(set(SPECS) | set(MODEL_ALIASES) | set(MODELS))


def resolve_model(name: str, dataset: str = "digits"):
    """Shape-only :class:`models.ModelSpec` of ``name``.

    Spec names (``resnet18``, ``resnet152``, ``wide_resnet50_2`` and aliases) have CIFAR-10
    shapes; trainable models (``cnn``, ``resnet``, ``mlp``) are built with their trainer defaults
    for ``dataset``'s input shape (so the layout is the one a run uses).

    Raises
    ------
    ValueError
        For an unknown model or dataset name (the message lists the valid ones).
    """
    canon = MODEL_ALIASES.get(name, name)
    if canon in SPECS:
        return get_spec(canon)
    if name in MODELS:
        if dataset not in DATASET_SHAPES:
            raise ValueError(f"unknown --dataset {dataset!r}; valid: {sorted(DATASET_SHAPES)}")
        shape, classes = DATASET_SHAPES[dataset]
        return build_model(name, shape, classes).spec()
    raise ValueError(f"unknown model {name!r}; valid models: {', '.join(model_names())}")


#: architecture arguments of :func:`models.resnet` that build the models of :mod:`models.specs`
#: (the tests check the parameter counts against the specs)
SPEC_ARCH = {
    "resnet18": {"block": "basic", "depths": (2, 2, 2, 2), "planes": (64, 128, 256, 512)},
    "resnet152": {"block": "bottleneck", "depths": (3, 8, 36, 3), "planes": (64, 128, 256, 512)},
    "wide_resnet50_2": {"block": "bottleneck", "depths": (3, 4, 6, 3),
                        "planes": (64, 128, 256, 512), "base_width": 128},
}


def build_trainable(model: str, dataset: str = "digits", xp=np):
    """A trainable :class:`models.Model` for ``model`` (spec names: CIFAR-10 shapes)."""
    canon = MODEL_ALIASES.get(model, model)
    if canon in SPEC_ARCH:
        return resnet((3, 32, 32), 10, xp=xp, **SPEC_ARCH[canon])
    resolve_model(model, dataset)  # validates the names
    shape, classes = DATASET_SHAPES[dataset]
    return build_model(model, shape, classes, xp=xp)
