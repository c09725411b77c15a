"""SyncTalk_2D's unet_328 and AudioEncoder written again for the tests, in numpy and float64, from the
networks' description (unet_328.py, utils.py), sharing nothing with gpu_actor/model_builder.py: the
importer's ONNX models are checked against it.

`Net` runs a network by its state_dict names. Given an empty state it creates the weights as it goes
(known random values, every convolution scaled by its own factor in 0.1..10, so that batch-norm statistics
lie far from 0 and 1) and sets each batch norm's running mean and variance to the statistics of what
reaches it, as training leaves them: a wrong fold of them shows in the output.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

EPS = 1e-5
AUDIO_SHAPES = {"ave": (32, 16, 16), "hubert": (32, 32, 32)}


class Net:
    def __init__(self, state: Optional[dict] = None, seed: int = 0):
        self.state = {} if state is None else state
        self.create = state is None
        self.rng = np.random.default_rng(seed)

    def _param(self, key: str, make) -> np.ndarray:
        if self.create and key not in self.state:
            self.state[key] = np.asarray(make(), np.float32)
        return self.state[key].astype(np.float64)

    def conv(self, x, name, cout, k=1, stride=1, pad=0, groups=1, bias=False, scale=None):
        cin = x.shape[1]
        gain = 10 ** self.rng.uniform(-1, 1) if scale is None else scale
        w = self._param(f"{name}.weight", lambda: self.rng.normal(0, gain * np.sqrt(2 / (cin // groups * k * k)),
                                                                    (cout, cin // groups, k, k)))
        y = conv2d(x, w, stride if isinstance(stride, tuple) else (stride, stride), pad, groups)
        if bias:
            y += self._param(f"{name}.bias", lambda: self.rng.normal(0, gain, cout))[None, :, None, None]
        return y

    def bn(self, x, name):
        if self.create:
            self.state[f"{name}.weight"] = self.rng.uniform(0.5, 1.5, x.shape[1]).astype(np.float32)
            self.state[f"{name}.bias"] = self.rng.normal(0, 0.3, x.shape[1]).astype(np.float32)
            self.state[f"{name}.running_mean"] = x.mean((0, 2, 3)).astype(np.float32)
            self.state[f"{name}.running_var"] = x.var((0, 2, 3)).astype(np.float32)
            self.state[f"{name}.num_batches_tracked"] = np.array(5000, np.int64)
        g, b, m, v = (self.state[f"{name}.{p}"].astype(np.float64)[None, :, None, None]
                      for p in ("weight", "bias", "running_mean", "running_var"))
        return (x - m) / np.sqrt(v + EPS) * g + b

    # unet_328.py
    def inverted_residual(self, x, name, cout, stride=1, residual=False):
        hidden = 2 * x.shape[1]
        y = relu(self.bn(self.conv(x, f"{name}.conv.0", hidden), f"{name}.conv.1"))
        y = relu(self.bn(self.conv(y, f"{name}.conv.3", hidden, 3, stride, 1, groups=hidden), f"{name}.conv.4"))
        y = self.bn(self.conv(y, f"{name}.conv.6", cout), f"{name}.conv.7")
        return x + y if residual else y

    def double_conv_dw(self, x, name, cout, stride):
        y = self.inverted_residual(x, f"{name}.double_conv.0", cout, stride)
        return self.inverted_residual(y, f"{name}.double_conv.1", cout, residual=True)

    def unet(self, visual, audio, mode="ave"):
        x1 = self.inverted_residual(visual, "inc.inconv.0", 32)
        x2 = self.double_conv_dw(x1, "down1.maxpool_conv.0", 32, 2)
        x3 = self.double_conv_dw(x2, "down2.maxpool_conv.0", 64, 2)
        x4 = self.double_conv_dw(x3, "down3.maxpool_conv.0", 128, 2)
        x5 = self.double_conv_dw(x4, "down4.maxpool_conv.0", 256, 2)
        x6 = self.double_conv_dw(x5, "down5.maxpool_conv.0", 512, 2)
        a = self.inverted_residual(audio, "audio_model.conv1", 64)
        a = self.inverted_residual(a, "audio_model.conv2", 128)
        a = relu(self.bn(self.conv(a, "audio_model.conv3", 256, 3, 2 if mode == "hubert" else 1, 1, bias=True),
                         "audio_model.bn3"))
        a = self.inverted_residual(a, "audio_model.conv4", 256, residual=True)
        a = relu(self.bn(self.conv(a, "audio_model.conv5", 512, 3, 2, 3, bias=True), "audio_model.bn5"))
        a = self.inverted_residual(a, "audio_model.conv6", 512, residual=True)
        a = self.inverted_residual(a, "audio_model.conv7", 512, residual=True)
        y = self.double_conv_dw(np.concatenate([x6, a], 1), "fuse_conv.0", 512, 1)
        y = self.double_conv_dw(y, "fuse_conv.1", 256, 1)
        for i, (skip, cout) in enumerate([(x5, 128), (x4, 64), (x3, 32), (x2, 32), (x1, 16)], 1):
            y = self.double_conv_dw(np.concatenate([upsample2(y), skip], 1), f"up{i}.conv", cout, 1)
        return sigmoid(self.conv(y, "outc.conv", 3, bias=True, scale=0.3))

    # utils.py: 13 blocks Conv2d(cin, cout, k, stride, padding[, residual]) = conv + batch norm [+ x] -> ReLU
    def audio_encoder(self, mel):
        x = mel
        blocks = ("32 3 1 1, 32 3 1 1 r, 32 3 1 1 r, 64 3 3x1 1, 64 3 1 1 r, 64 3 1 1 r, 128 3 3 1, 128 3 1 1 r, "
                  "128 3 1 1 r, 256 3 3x2 1, 256 3 1 1 r, 512 3 1 0, 512 1 1 0")
        for i, block in enumerate(blocks.split(", ")):
            cout, k, stride, pad, *residual = block.split()
            s = tuple(int(v) for v in stride.split("x")) if "x" in stride else int(stride)
            y = self.bn(self.conv(x, f"audio_encoder.{i}.conv_block.0", int(cout), int(k), s, int(pad), bias=True),
                        f"audio_encoder.{i}.conv_block.1")
            x = relu(y + x if residual else y)
        return x.reshape(len(x), -1)


def relu(x):
    return np.maximum(x, 0)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def conv2d(x, w, stride, pad, groups):
    """Cross-correlation as torch's Conv2d computes it, one kernel tap at a time."""
    n, c, h, wd = x.shape
    cout, _, kh, kw = w.shape
    sh, sw = stride
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - kh) // sh + 1, (wd + 2 * pad - kw) // sw + 1
    y = np.zeros((n, cout, ho, wo))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
            if groups == 1:
                y += np.matmul(w[:, :, i, j], patch.reshape(n, c, -1)).reshape(n, cout, ho, wo)
            else:   # depthwise: groups == channels
                assert groups == c == cout
                y += w[None, :, 0, i, j, None, None] * patch
    return y


def upsample2(x):
    """nn.Upsample(scale_factor=2, mode='bilinear', align_corners=True)."""
    def weights(size):
        src = np.arange(2 * size) * (size - 1) / (2 * size - 1)
        lo = np.minimum(np.floor(src).astype(int), size - 2)
        frac = src - lo
        m = np.zeros((2 * size, size))
        m[np.arange(2 * size), lo] += 1 - frac
        m[np.arange(2 * size), lo + 1] += frac
        return m
    return np.einsum("ih,nchw,jw->ncij", weights(x.shape[2]), x, weights(x.shape[3]), optimize=True)
