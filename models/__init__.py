"""models — NumPy/CuPy layers, models (MLP, CNN, ResNet, ViT, GPT), datasets, SGD / AdamW.

See DESIGN.md.  Every model keeps all trainable parameters in one flat vector
(``model.params.flat``) and all gradients in another (``model.grads.flat``); each named tensor
is a view into them (``model.params[name]``), laid out in backward order.
"""

from .data import (DATASETS, Dataset, DatasetFormatError, DatasetNotFoundError, DatasetSplit,
                   ShardSplit, channel_stats, iterate_batches, load_cifar10, load_dataset,
                   load_digits, load_mnist, load_shard, make_synthetic, normalize, num_batches,
                   read_idx, shard)
from .layers import (BasicBlock, BatchNorm2d, Bottleneck, Conv2d, Flatten, GlobalAvgPool2d,
                     Layer, Linear, MaxPool2d, ReLU, Sequential, SoftmaxCrossEntropy,
                     softmax_cross_entropy)
from .network import Model
from .optim import (OPTIMIZERS, SCHEDULES, SGD, AdamW, AdamWConfig, ConstantLR, CosineLR,
                    MaskHook, ProximalHook, SGDConfig, StepLR, make_optimizer, make_schedule)
from .params import PARAM_KINDS, FlatTensors, ParamLayout, ParamSpec
from .specs import SPECS, ModelSpec, get_spec, resnet18_spec, resnet152_spec, wide_resnet50_2_spec
from .text import TEXT_DATASETS, load_text, unigram_entropy
from .transformer import TransformerModel, gpt, vit
from .zoo import MODELS, build_model, cnn, mlp, resnet

# the embedded text corpus joins the --dataset registry (its loader lives in models.text)
for _name, _loader in TEXT_DATASETS.items():
    DATASETS.setdefault(_name, _loader)

__all__ = [
    "DATASETS", "Dataset", "DatasetFormatError", "DatasetNotFoundError", "DatasetSplit",
    "ShardSplit", "channel_stats", "iterate_batches", "load_cifar10", "load_dataset",
    "load_digits", "load_mnist", "load_shard", "make_synthetic", "normalize", "num_batches",
    "read_idx", "shard",
    "BasicBlock", "BatchNorm2d", "Bottleneck", "Conv2d", "Flatten", "GlobalAvgPool2d", "Layer",
    "Linear", "MaxPool2d", "ReLU", "Sequential", "SoftmaxCrossEntropy", "softmax_cross_entropy",
    "Model", "OPTIMIZERS", "SCHEDULES", "SGD", "AdamW", "AdamWConfig", "make_optimizer",
    "ConstantLR", "CosineLR", "MaskHook", "ProximalHook",
    "SGDConfig", "StepLR", "make_schedule", "PARAM_KINDS", "FlatTensors", "ParamLayout",
    "ParamSpec", "SPECS", "ModelSpec", "get_spec", "resnet18_spec", "resnet152_spec",
    "wide_resnet50_2_spec", "MODELS", "build_model", "cnn", "mlp", "resnet",
    "TEXT_DATASETS", "load_text", "unigram_entropy", "TransformerModel", "gpt", "vit",
]
