"""Model presets of the papers, and the hook for any user ``nn.Module``.

- ``mlp``: JGL Fig. 3 MLP -- three fully connected layers with ReLU, hidden
  sizes 512-128 for 28x28 inputs and 2048-512 for CIFAR-10 (3x32x32).
  FedGroup's one-hidden-layer MLP is ``mlp`` with ``hidden=[128]``.
- ``cnn``: JGL Fig. 3 CNN -- for 1-channel 28x28 inputs conv(32, 3x3) ->
  conv(64, 3x3) -> maxpool 2 -> fc 128; for 3x32x32 inputs the LeNet-like
  conv(6, 5x5) -> pool -> conv(16, 5x5) -> pool -> fc 120 -> fc 84.
- ``lenet``: the LeNet-like CNN on any input size: JGL Fig. 3's CIFAR-10 CNN and
  CFLGT Sec. V-A's "Lenet" (PyTorch's CIFAR-10 tutorial network, whose SGD
  settings, lr 0.001 and momentum 0.9, CFLGT uses). ``cnn`` and ``lenet`` take
  ``dropout`` (default 0: none).
- ``ifca_cnn``: IFCA's CIFAR-10 CNN (TensorFlow's CIFAR-10 tutorial model, as
  the reference code github.com/jichan3751/ifca ``cifar/cifar10.py`` builds it):
  two 5x5 convolutions of 64 channels with max-pooling and local response
  normalisation, fc 384, fc 192.
- ``fedcluster.models:resnet8`` (by import path, not a paper's preset): a CIFAR
  ResNet-8 with BatchNorm (He et al. 2016, one basic block per stage),
  ``width`` channels in its first stage (default 16).
- ``mclr``: multinomial logistic regression (FedGroup Table II, FedProx).
- ``dnn``: a 2-layer fully connected network (one hidden layer, default 200).
- ``lstm``: FedProx's / FedGroup's Sent140 classifier (FedGroup Table II):
  embedding -> 2-layer LSTM (100 hidden units) -> fc 30 -> fc ``n_classes``
  on int64 token ids (:mod:`fedcluster.data.leaf`), with a learnable embedding.

Any other model is an import path ``"package.module:factory"`` whose factory
takes ``(input_shape, n_classes, **options)`` and returns an ``nn.Module``; in
Python, pass the module itself to :class:`fedcluster.experiment.runner.Experiment`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Self

import torch
from torch import nn

from fedcluster.config.plugins import import_object, is_import_path
from fedcluster.errors import ConfigError
from fedcluster.memory import allowed_bytes, physical_bytes

InputShape = tuple[int, ...]


def _flat_size(shape: InputShape) -> int:
    return math.prod(shape)


MAX_WIDTH = 10_000_000
"""Widest layer a model option may ask for (a width of 0 divided by zero in the
initialisation; larger ones are typos, and the memory check catches what fits below)."""


def mlp(input_shape: InputShape, n_classes: int, hidden: Sequence[int] | None = None) -> nn.Module:
    """JGL Fig. 3 MLP: Flatten -> [Linear -> ReLU]* -> Linear."""
    if hidden is None:
        hidden = [2048, 512] if _flat_size(input_shape) >= 3 * 32 * 32 else [512, 128]
    if not isinstance(hidden, list | tuple) or not all(
        type(h) is int and 1 <= h <= MAX_WIDTH for h in hidden
    ):
        raise ConfigError(
            f"model option hidden: a list of layer widths 1..{MAX_WIDTH:,}, got {hidden!r}"
        )
    layers: list[nn.Module] = [nn.Flatten()]
    width = _flat_size(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


def dnn(input_shape: InputShape, n_classes: int, hidden: int = 200) -> nn.Module:
    """A 2-layer DNN (one hidden layer of ``hidden`` ReLU units)."""
    return mlp(input_shape, n_classes, hidden=[hidden])


def mclr(input_shape: InputShape, n_classes: int) -> nn.Module:
    """Multinomial logistic regression: Flatten -> Linear (softmax in the loss)."""
    return mlp(input_shape, n_classes, hidden=[])


def lenet(input_shape: InputShape, n_classes: int, dropout: float = 0.0) -> nn.Module:
    """JGL Fig. 3 CIFAR-10 CNN (LeNet-like): conv 6@5x5, pool, conv 16@5x5, pool, 120, 84.

    The same network is CFLGT Sec. V-A's "Lenet" for CIFAR-10 and SVHN (PyTorch's
    CIFAR-10 tutorial ``Net``: 62,006 parameters for 3x32x32 inputs and 10 classes).

    ``dropout`` > 0 adds ``nn.Dropout(dropout)`` after fc 120 and fc 84.
    """
    channels, height, width = _image_shape(input_shape)
    h, w = (height - 4) // 2, (width - 4) // 2
    h, w = (h - 4) // 2, (w - 4) // 2
    drop = [nn.Dropout(dropout)] if dropout > 0.0 else []
    return nn.Sequential(
        nn.Conv2d(channels, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * h * w, 120),
        nn.ReLU(),
        *drop,
        nn.Linear(120, 84),
        nn.ReLU(),
        *drop,
        nn.Linear(84, n_classes),
    )


def _same_pool(size: int) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding (before, after) of a 3x3 stride-2 pooling of ``size``
    pixels: the output has ceil(size/2), the extra pixel goes after."""
    total = max((math.ceil(size / 2) - 1) * 2 + 3 - size, 0)
    return total // 2, total - total // 2


class _TruncatedNormalInit:
    """Mixin of :class:`nn.Conv2d` / :class:`nn.Linear`: ``reset_parameters`` draws the
    weights from a normal of std ``init_std`` cut at 2 std (TensorFlow's
    ``truncated_normal_initializer``) and sets the bias to ``init_bias``. Runs again
    wherever fedcluster re-initialises a model (``init_row``), so the initialisation
    is the layer's, not PyTorch's default."""

    init_std: float
    init_bias: float

    def configure(self, std: float, bias: float) -> Self:
        self.init_std, self.init_bias = std, bias
        self.reset_parameters()
        return self

    def reset_parameters(self) -> None:
        if not hasattr(self, "init_std"):  # the base class's __init__: not configured yet
            super().reset_parameters()  # type: ignore[misc]
            return
        std = self.init_std
        nn.init.trunc_normal_(self.weight, std=std, a=-2 * std, b=2 * std)  # type: ignore[attr-defined]
        nn.init.constant_(self.bias, self.init_bias)  # type: ignore[attr-defined]


class _TFConv2d(_TruncatedNormalInit, nn.Conv2d):
    """A convolution with TensorFlow-style initialisation (:class:`_TruncatedNormalInit`)."""


class _TFLinear(_TruncatedNormalInit, nn.Linear):
    """A linear layer with TensorFlow-style initialisation (:class:`_TruncatedNormalInit`)."""


def ifca_cnn(input_shape: InputShape, n_classes: int) -> nn.Module:
    """IFCA's CIFAR-10 CNN (Ghosh et al. 2020, Sec. 5.2; reference code
    github.com/jichan3751/ifca ``cifar/cifar10.py`` ``inference``, TensorFlow's
    CIFAR-10 tutorial model).

    conv 64@5x5 'same' -> ReLU -> max-pool 3x3 stride 2 'same' -> LRN -> conv
    64@5x5 'same' -> ReLU -> LRN -> max-pool 3x3/2 'same' -> fc 384 -> fc 192 ->
    ``n_classes``. TensorFlow's ``lrn(depth_radius=4, bias=1, alpha=0.001/9,
    beta=0.75)`` is PyTorch's ``LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1)``
    (PyTorch divides alpha by the window size); 'same' pooling pads after the
    image as TensorFlow does (with zeros, which after a ReLU equals its -inf).
    The initialisation is the reference's: truncated normal weights (std 0.05
    for the convolutions, 0.04 for fc 384 and fc 192, 1/192 for the logits,
    cut at 2 std) and biases 0 (conv1, logits) or 0.1 (the others).

    On the reference's 24x24 crops fc 384 sees 6·6·64 inputs and the model has
    1,068,298 parameters for 10 classes; on uncropped 32x32 images 8·8·64
    (1,756,426). Not reproduced: the reference's weight decay of 0.004 on fc 384
    and fc 192 (the loss here has no L2 term).
    """
    channels, height, width = _image_shape(input_shape)
    (t1, b1), (l1, r1) = _same_pool(height), _same_pool(width)
    h, w = math.ceil(height / 2), math.ceil(width / 2)
    (t2, b2), (l2, r2) = _same_pool(h), _same_pool(w)
    h, w = math.ceil(h / 2), math.ceil(w / 2)
    return nn.Sequential(
        _TFConv2d(channels, 64, 5, padding=2).configure(0.05, 0.0),
        nn.ReLU(),
        nn.ZeroPad2d((l1, r1, t1, b1)),
        nn.MaxPool2d(3, 2),
        nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0),
        _TFConv2d(64, 64, 5, padding=2).configure(0.05, 0.1),
        nn.ReLU(),
        nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0),
        nn.ZeroPad2d((l2, r2, t2, b2)),
        nn.MaxPool2d(3, 2),
        nn.Flatten(),
        _TFLinear(64 * h * w, 384).configure(0.04, 0.1),
        nn.ReLU(),
        _TFLinear(384, 192).configure(0.04, 0.1),
        nn.ReLU(),
        _TFLinear(192, n_classes).configure(1 / 192, 0.0),
    )


def cnn(input_shape: InputShape, n_classes: int, dropout: float = 0.0) -> nn.Module:
    """JGL Fig. 3 CNN: conv 32@3x3, conv 64@3x3, maxpool 2, fc 128 (LeNet for RGB 32x32).

    ``dropout`` > 0 adds ``nn.Dropout(dropout)`` after the pooling and after fc 128
    (the Keras MNIST CNN's placement; LeNet's own for RGB); 0 leaves the preset as it was.
    """
    channels, height, width = _image_shape(input_shape)
    if channels == 3:
        return lenet(input_shape, n_classes, dropout)
    h, w = (height - 4) // 2, (width - 4) // 2
    drop = [nn.Dropout(dropout)] if dropout > 0.0 else []
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        *drop,
        nn.Flatten(),
        nn.Linear(64 * h * w, 128),
        nn.ReLU(),
        *drop,
        nn.Linear(128, n_classes),
    )


class BasicBlock(nn.Module):
    """He et al. 2016's basic residual block: two 3x3 conv-BatchNorm layers and a
    shortcut (a 1x1 conv-BatchNorm where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet8(input_shape: InputShape, n_classes: int, width: int = 16) -> nn.Module:
    """A ResNet-8 (He et al. 2016's CIFAR ResNet with one block per stage): conv-BN
    stem of ``width`` channels, three basic blocks of width, 2·width and 4·width
    channels (strides 1, 2, 2), global average pooling, a linear classifier."""
    channels, _, _ = _image_shape(input_shape)
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        BasicBlock(width, width, 1),
        BasicBlock(width, 2 * width, 2),
        BasicBlock(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, n_classes),
    )


class SentimentLSTM(nn.Module):
    """FedProx's Sent140 ``stacked_lstm`` (``flearn/models/sent140/stacked_lstm.py``).

    Embedding -> ``layers`` stacked LSTMs of ``hidden`` units -> Linear(``fc``)
    -> Linear(``n_classes``), read at each sequence's last real token (id 0 is
    padding at the end). FedProx's defaults (``MODEL_PARAMS['sent140.stacked_lstm']
    = (25, 2, 100)``, 300-d GloVe) give FedGroup Table II's 243,861 trainable
    parameters for a frozen embedding (4·100·(300+100+1) + 4·100·(100+100+1) +
    100·30+30 + 30+1). Differences: the embedding is learnable (GloVe is not
    available offline; ``vocab_size`` x ``embedding_dim`` more parameters), the
    head has ``n_classes`` logits for cross-entropy instead of one sigmoid logit
    (31 parameters more for 2 classes), and PyTorch's LSTM has two bias vectors
    per layer where TensorFlow's ``BasicLSTMCell`` has one (800 more).
    """

    def __init__(
        self,
        seq_len: int,
        n_classes: int,
        vocab_size: int,
        embedding_dim: int,
        hidden: int,
        layers: int,
        fc: int,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=0)
        self.lstm = nn.LSTM(embedding_dim, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, fc)
        self.out = nn.Linear(fc, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.long()
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            raise ConfigError(
                f"model lstm: token id {int(ids.max())} >= vocab_size {self.vocab_size}; "
                "set model.options.vocab_size to the dataset's vocab_size"
            )
        states, _ = self.lstm(self.embedding(ids))  # [B, T, hidden]
        last = ((ids != 0).sum(dim=1) - 1).clamp(min=0)  # last real token (all-pad: the first)
        h = states[torch.arange(len(ids)), last]
        return self.out(self.fc(h))


def lstm(
    input_shape: InputShape,
    n_classes: int,
    vocab_size: int = 10_000,
    embedding_dim: int = 300,
    hidden: int = 100,
    layers: int = 2,
    fc: int = 30,
) -> nn.Module:
    """FedGroup's Sent140 LSTM on token ids ``[seq_len]`` (see :class:`SentimentLSTM`)."""
    if len(input_shape) != 1:
        raise ConfigError(f"model: lstm needs token-id inputs [seq_len], got shape {input_shape}")
    return SentimentLSTM(input_shape[0], n_classes, vocab_size, embedding_dim, hidden, layers, fc)


def _image_shape(input_shape: InputShape) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError(
            f"model: a convolutional model needs image inputs [C, H, W], got shape {input_shape}"
        )
    return input_shape[0], input_shape[1], input_shape[2]


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "cnn": cnn,
    "lenet": lenet,
    "ifca_cnn": ifca_cnn,
    "mclr": mclr,
    "dnn": dnn,
    "lstm": lstm,
}


FLOAT_BYTES = 4


def check_trainable(model: nn.Module, what: str) -> None:
    """ConfigError naming ``what`` when ``model`` has no parameters, or names the
    parameters with ``requires_grad=False``: every training path updates every
    parameter row, so a frozen layer would be trained."""
    if next(model.parameters(), None) is None:
        raise ConfigError(f"{what}: the model has no parameters to train")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        shown = ", ".join(frozen[:5]) + (f" and {len(frozen) - 5} more" if len(frozen) > 5 else "")
        raise ConfigError(
            f"{what}: parameters {shown} have requires_grad=False; fedcluster trains every "
            "parameter of a model, so frozen layers are refused: set requires_grad=True, or "
            "keep fixed layers out of the model (e.g. as a fixed feature transform of the data)"
        )


@contextmanager
def module_mode(module: nn.Module, training: bool) -> Iterator[nn.Module]:
    """Run with every submodule in training (or evaluation) mode; restore each one's mode."""
    before = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield module
    finally:
        for m, mode in before:
            m.training = mode


class ModelContractError(ConfigError):
    """A model that does not map a batch to logits of one row per sample and class."""


def check_model_contract(model: nn.Module, x: torch.Tensor, n_classes: int, what: str) -> None:
    """ModelContractError naming ``what`` unless ``model`` (with parameters) maps the sample
    batch ``x`` to a floating-point tensor of logits of shape ``(len(x), n_classes)``.

    The model runs once in evaluation mode without gradients (no running statistics
    move, no dropout mask is drawn) and its modes are restored; a model that breaks its
    contract is then one line here rather than a traceback from a loss deep in training,
    or predictions of classes that do not exist.
    """
    if len(x) == 0:
        return
    x = x.to(next(model.parameters()).device)
    try:
        with torch.no_grad(), module_mode(model, False):
            out = model(x)
    except Exception as exc:  # noqa: BLE001 -- user code: any failure is named, not raised
        raise ModelContractError(
            f"{what}: the model's forward pass on a batch of shape {tuple(x.shape)} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    expected = (len(x), n_classes)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        got = f"{out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelContractError(f"{what}: the model returned {got}, not floating-point logits")
    if tuple(out.shape) != expected:
        raise ModelContractError(
            f"{what}: the model returned logits of shape {tuple(out.shape)} for a batch of "
            f"{len(x)}; expected {expected} ({n_classes} classes)"
        )


def check_rows_fit(name: str, model: nn.Module, rows: int) -> None:
    """ConfigError naming the model when ``rows`` parameter rows of it cannot fit in memory.

    A round holds one flat row per participating client (their uploads, [n, d]),
    so a model that fits alone may still not fit a round.
    """
    count = sum(p.numel() for p in model.parameters())
    need = count * FLOAT_BYTES * rows
    have = allowed_bytes()
    if need > have:
        raise ConfigError(
            f"model: {name!r} has {count:,} parameters; a round's {rows} model rows need "
            f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB this process may "
            "allocate (the least of MemAvailable, the cgroup limit and ulimit -v)"
        )


def parameter_count(
    factory: Callable[..., nn.Module], input_shape: InputShape, n_classes: int, options: dict
) -> int | None:
    """Parameters the factory's model would have, counted on PyTorch's meta device (no memory).

    ``None`` when the factory cannot be built that way (the real build reports its own errors).
    """
    try:
        with torch.device("meta"):
            probe = factory(tuple(input_shape), n_classes, **options)
        return sum(p.numel() for p in probe.parameters())
    except Exception:  # noqa: BLE001 -- only a probe: the real build names the problem
        return None


def build_model(name: str, input_shape: InputShape, n_classes: int, **options) -> nn.Module:
    """Build a preset model by name, or a user model from ``"package.module:factory"``."""
    if is_import_path(name):
        try:
            factory = import_object(name, "model")
        except ConfigError as exc:
            raise ConfigError(f"model.name: {exc}") from None
    elif name in MODELS:
        factory = MODELS[name]
    else:
        allowed = ", ".join(sorted(MODELS))
        raise ConfigError(
            f"model.name: unknown model {name!r}; allowed: {allowed}, or 'package.module:factory'"
        )
    count = parameter_count(factory, input_shape, n_classes, options)
    if count is not None and count * FLOAT_BYTES > physical_bytes():
        raise ConfigError(
            f"model: {name!r} has {count:,} parameters ({count * FLOAT_BYTES / 2**30:.1f} GiB "
            f"as float32), more than this machine's memory ({physical_bytes() / 2**30:.1f} GiB)"
        )
    try:
        model = factory(tuple(input_shape), n_classes, **options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model: bad options {options} for {name!r}: {exc}") from None
    except (MemoryError, RuntimeError) as exc:  # e.g. "DefaultCPUAllocator: can't allocate"
        size = "" if count is None else f" with {count:,} parameters"
        raise ConfigError(f"model: {name!r}{size} cannot be allocated: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: {name!r} returned {type(model).__name__}, not an nn.Module")
    return model
