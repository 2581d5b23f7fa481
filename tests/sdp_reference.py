"""N-SDP's masked layers read from a model's layer shapes alone (the second source of the SDP
plan and run tests)."""

import itertools

import numpy as np

__all__ = ["neuron_layers", "param_size"]


def param_size(L, name):
    return int(np.prod(L.shape(name)))


def neuron_layers(model):
    """``[(width, params per neuron, buffers per neuron)]`` of the layers N-SDP masks, and the
    parameters left on every worker, from the layer shapes alone."""
    L = model.layout
    names = set(L.names)
    blocks = sorted({".".join(n.split(".")[:2]) for n in names if n.startswith("layer")})
    if blocks:  # ResNet: each block's inner channels (conv1's outputs, bn1, conv2's inputs)
        layers = []
        for b in blocks:
            w = L.shape(f"{b}.conv1.weight")[0]
            per = (param_size(L, f"{b}.conv1.weight") + param_size(L, f"{b}.bn1.weight")
                   + param_size(L, f"{b}.bn1.bias") + param_size(L, f"{b}.conv2.weight")) // w
            layers.append((w, per, 2))
    else:  # plain chain conv1 -> conv2 -> fc1 -> fc2: hidden layers conv1, conv2, fc1
        chain = ["conv1", "conv2", "fc1", "fc2"]
        hidden = []
        for a, nxt in itertools.pairwise(chain):
            w = L.shape(f"{a}.weight")[0]
            per = (param_size(L, f"{a}.weight") + param_size(L, f"{a}.bias")
                   + param_size(L, f"{nxt}.weight")) // w
            hidden.append((w, per, 0))
        # non-adjacent subsets, the one holding the most parameters (ties: earlier layers)
        best = max((s for r in range(len(hidden) + 1)
                    for s in itertools.combinations(range(len(hidden)), r)
                    if all(b - a > 1 for a, b in itertools.pairwise(s))),
                   key=lambda s: (sum(hidden[i][0] * hidden[i][1] for i in s),
                                  [-i for i in s]))
        layers = [hidden[i] for i in best]
    masked = sum(w * per for w, per, _ in layers)
    return layers, L.total - masked
