"""``--arch``: one table of keys per model (models/arch.py), typed, range-checked and
combination-checked; every refusal names ``--arch KEY``, the value, what is allowed and an
example, and every value it accepts builds the model."""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest

from models import DATASETS, MODELS, build_model, load_dataset
from models.arch import (
    ARCH,
    DATA_INPUTS,
    DATA_KEYS,
    MODEL_INPUTS,
    arch_help,
    check_model_dataset,
    parse_arch,
    split_arch,
)


def _build(model: str, dataset: str, arch) -> None:
    """Build ``model`` with the checked ``arch`` for ``dataset``'s inputs (no data loaded)."""
    kw, data_kw = split_arch(arch, model, dataset)
    kind, shape = DATA_INPUTS[dataset]
    if kind == "tokens":
        shape, classes = (data_kw.get("context", 64),), 256
    else:
        classes = 10
    build_model(model, shape, classes, **kw)


def test_table_is_the_factories_signatures():
    for model, factory in MODELS.items():
        params = inspect.signature(factory).parameters
        kw = {k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert set(ARCH[model]) == kw - {"xp", "dtype", "seed"}, model
    assert set(ARCH) == set(MODELS) == set(MODEL_INPUTS)
    assert set(DATA_INPUTS) == set(DATASETS)
    for model, keys in ARCH.items():
        assert f"{model}: {', '.join(keys)}" in arch_help()


@pytest.mark.parametrize("dataset", ["digits", "synthetic", "text"])
def test_declared_inputs_are_the_loaded_ones(dataset):
    kind, shape = DATA_INPUTS[dataset]
    train = load_dataset(dataset).train
    if kind == "images":
        assert train.input_shape == shape
    else:
        assert train.x.ndim == 2 and np.issubdtype(train.x.dtype, np.integer)


@pytest.mark.parametrize("model,key", [(m, k) for m, keys in ARCH.items() for k in keys])
def test_every_example_builds(model, key):
    dataset = "text" if "tokens" == MODEL_INPUTS[model][0] else "digits"
    arch = parse_arch([f"{key}={ARCH[model][key].example}"], model, dataset)
    _build(model, dataset, arch)


@pytest.mark.parametrize("items,model,dataset,check", [
    (["mlp_ratio=1.5"], "vit", "digits", lambda m: m.params["blocks.0.mlp.fc1.weight"].shape == (96, 64)),
    (["mlp_ratio=0.75", "dim=32", "heads=2"], "gpt", "text", None),
    (["hidden=1024,1024"], "mlp", "digits", lambda m: m.num_params > 1024 * 1024),
    (["hidden="], "mlp", "digits", lambda m: m.num_params == 64 * 10 + 10),
    (["depths=2", "planes=8,16"], "resnet", "digits", None),
    (["planes=8,", "depths=2"], "resnet", "digits", None),
    (["block=bottleneck", "base_width=128", "depths=1,1,1"], "resnet", "digits", None),
    (["tie=true", "context=16", "init=he"], "gpt", "text", None),
    (["patch=4", "pool=mean", "dim=24", "heads=3"], "vit", "digits", None),
    (["hidden=16"], "mlp", "text", None),
], ids=lambda v: ",".join(v) if isinstance(v, list) else None)
def test_legitimate_values_build(items, model, dataset, check):
    arch = parse_arch(items, model, dataset)
    kw, data_kw = split_arch(arch, model, dataset)
    shape = ((data_kw.get("context", 64),) if DATA_INPUTS[dataset][0] == "tokens"
             else DATA_INPUTS[dataset][1])
    m = build_model(model, shape, 256 if dataset == "text" else 10, **kw)
    assert check is None or check(m)
    assert parse_arch(arch, model, dataset) == arch      # typed pairs pass unchanged


#: (items, model, dataset, fragments of the one message); 30+ shapes of the reports and more
BAD = [
    (["dim=abc"], "vit", "digits", ["--arch dim=abc", "whole number from 1", "e.g. --arch dim="]),
    (["depth=1.5"], "vit", "digits", ["--arch depth=1.5", "whole number", "e.g. --arch depth="]),
    (["depth=0"], "gpt", "text", ["--arch depth=0", "from 1 to 1024"]),
    (["dim=0"], "vit", "digits", ["--arch dim=0", "from 1 to 65536"]),
    (["dim=-8"], "gpt", "text", ["--arch dim=-8", "from 1 to 65536"]),
    (["heads=0"], "vit", "digits", ["--arch heads=0", "whole number from 1"]),
    (["heads=3"], "vit", "digits", ["--arch heads=3", "must divide the width dim=64",
                                    "e.g. --arch heads=2"]),
    (["dim=30"], "gpt", "text", ["--arch dim=30", "heads=4 must divide", "divisors of 30"]),
    (["mlp_ratio=0"], "vit", "digits", ["--arch mlp_ratio=0", "a number > 0 and <= 64",
                                        "e.g. --arch mlp_ratio=1.5"]),
    (["mlp_ratio=nan"], "vit", "digits", ["--arch mlp_ratio=nan", "> 0 and <= 64"]),
    (["mlp_ratio=inf"], "gpt", "text", ["--arch mlp_ratio=inf", "> 0 and <= 64"]),
    (["mlp_ratio=abc"], "gpt", "text", ["--arch mlp_ratio=abc", "a number"]),
    (["mlp_ratio=0.001"], "vit", "digits", ["--arch mlp_ratio=0.001", "feed-forward width",
                                            "at least 1"]),
    (["patch=3"], "vit", "digits", ["--arch patch=3", "must divide the 8x8 images",
                                    "e.g. --arch patch=2"]),
    (["patch=5"], "vit", "cifar10", ["--arch patch=5", "32x32 images of --dataset cifar10"]),
    (["patch=0"], "vit", "digits", ["--arch patch=0", "whole number from 1"]),
    (["pool=max"], "vit", "digits", ["--arch pool=max", "one of cls, mean, last"]),
    (["init=xavier"], "gpt", "text", ["--arch init=xavier", "one of gpt2, he"]),
    (["tie=maybe"], "gpt", "text", ["--arch tie=maybe", "true or false"]),
    (["context=16"], "vit", "digits", ["--arch context=16", "read by --dataset text",
                                       "--model vit has no key 'context'"]),
    (["context=0"], "gpt", "text", ["--arch context=0", "whole number from 1"]),
    (["context=10000000"], "gpt", "text", ["--arch context=10000000", "from 1 to 46"]),
    (["context=1.5"], "mlp", "text", ["--arch context=1.5", "whole number"]),
    (["foo=1"], "cnn", "digits", ["--arch foo=1", "--model cnn has no key 'foo'",
                                  "channels, hidden", "e.g. --arch channels=16,32"]),
    (["hidden=0"], "mlp", "digits", ["--arch hidden=0", "whole numbers from 1"]),
    (["hidden=1024,abc"], "mlp", "digits", ["--arch hidden=1024,abc", "whole numbers",
                                            "e.g. --arch hidden=1024,1024"]),
    (["hidden=1.5"], "cnn", "digits", ["--arch hidden=1.5", "whole number"]),
    (["channels=16"], "cnn", "digits", ["--arch channels=16", "2 comma-separated"]),
    (["channels=16,32,64"], "cnn", "digits", ["--arch channels=16,32,64", "2 comma-separated"]),
    (["channels=0,8"], "cnn", "digits", ["--arch channels=0,8", "from 1"]),
    (["depths=2,2"], "resnet", "digits", ["--arch depths=2,2", "planes=16,32,64 3",
                                          "e.g. --arch depths=2,2,2"]),
    (["depths=0"], "resnet", "digits", ["--arch depths=0", "whole numbers from 1"]),
    (["planes=16,x"], "resnet", "digits", ["--arch planes=16,x", "whole numbers"]),
    (["block=wide"], "resnet", "digits", ["--arch block=wide", "one of basic, bottleneck"]),
    (["block=bottleneck", "base_width=1"], "resnet", "digits",
     ["--arch base_width=1", "inner width", "e.g. --arch base_width=64"]),
    (["stem_channels=0"], "resnet", "digits", ["--arch stem_channels=0", "whole number"]),
    (["dim"], "vit", "digits", ["--arch takes KEY=VALUE, got 'dim'", "e.g. --arch patch=2"]),
    (["=4"], "vit", "digits", ["--arch takes KEY=VALUE"]),
    ([], "vit", "text", ["--model vit reads images", "--dataset text holds byte windows",
                         "--model gpt / mlp with --dataset text"]),
    ([], "gpt", "digits", ["--model gpt reads byte windows", "use --dataset text"]),
    ([], "cnn", "text", ["--model cnn reads images"]),
]


@pytest.mark.parametrize("items,model,dataset,fragments", BAD,
                         ids=[f"{m}-{d}-{','.join(i) or 'none'}" for i, m, d, _ in BAD])
def test_bad_arch_is_one_message_naming_the_key(items, model, dataset, fragments):
    with pytest.raises(ValueError) as exc:
        parse_arch(items, model, dataset)
    text = str(exc.value)
    assert "\n" not in text
    for f in fragments:
        assert f in text, text
    if items and "=" in items[-1] and not items[-1].startswith("="):
        assert "e.g. --arch " in text, text


#: values tried for every key of every model: each is refused naming the key, or builds
FUZZ = ["abc", "1.5", "0", "-1", "nan", "inf", "", "1,2", "2,", "true", "2", "3"]


@pytest.mark.parametrize("model", sorted(ARCH))
def test_every_value_is_refused_by_name_or_builds(model):
    dataset = "text" if MODEL_INPUTS[model] == ("tokens",) else "digits"
    keys = list(ARCH[model]) + list(DATA_KEYS.get(dataset, {}))
    for key, value in itertools.product(keys, FUZZ):
        try:
            arch = parse_arch([f"{key}={value}"], model, dataset)
        except ValueError as exc:
            assert str(exc).startswith(f"--arch {key}={value}:"), (key, value, str(exc))
            continue
        _build(model, dataset, arch)          # accepted: the model builds


def test_unknown_model_and_dataset_name_the_flag():
    with pytest.raises(ValueError, match="unknown --model 'bert'; valid: cnn, gpt"):
        check_model_dataset("bert", "digits")
    with pytest.raises(ValueError, match="unknown --dataset 'imagenet'"):
        check_model_dataset("cnn", "imagenet")


def test_train_config_checks_its_arch():
    from models.train import TrainConfig

    with pytest.raises(ValueError, match="--arch heads=5"):
        TrainConfig(model="vit", arch=(("heads", 5),))
    with pytest.raises(ValueError, match="--arch depths=1.5"):
        TrainConfig(model="resnet", arch=(("depths", 1.5),))
    assert TrainConfig(model="vit", arch=(("mlp_ratio", 1.5),)).arch == (("mlp_ratio", 1.5),)
