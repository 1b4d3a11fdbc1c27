"""Training configuration: YAML (yaml.safe_load) -> typed dataclasses, with ``--set a.b=value``
overrides. Unknown keys and ill-typed values are ValueErrors naming the key."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import yaml


PIPELINES = ("auto", "device", "loader")
COMPILE_CHOICES = (False, True, "model", "blocks", "auto")
GRAPH_CHOICES = (False, True, "auto")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs themselves
LR_SCALING = ("none", "linear", "sqrt")


@dataclass
class ModelConfig:
    name: str = "vit"                 # vit | otvit
    attention: str = "softmax"        # attnzoo spec string for every layer (OT-ViT: all but the last)
    patch_size: int = 4
    embed_dim: int = 256
    depth: int = 6
    num_heads: int = 8
    mlp_ratio: float = 2.0
    dropout: float = 0.2              # embedding, projection and MLP dropout
    attn_dropout: float = 0.0         # dropout on the attention weights
    qkv_bias: bool = True
    ot_alpha: float = 1.0
    ot_gamma: Union[float, str] = "sqrt_embed_dim"  # or sqrt_head_dim, or a number
    template_tokens: str = "all"      # all | patches: which partner tokens become templates
    template_grad: bool = True        # gradients through the partner's pass
    ot_backend: Optional[str] = None  # OT kernel (attnzoo.explain("ot", ...)); null = auto
    ot_queries: str = "cls"           # cls | all: last layer computed for the class token only (same logits)


@dataclass
class DataConfig:
    dataset: str = "fashion_mnist"    # fashion_mnist | cifar10 | cifar100
    data_dir: Optional[str] = None    # local copy (must exist); default ./data (CIFAR) or the Debian files (Fashion-MNIST)
    download: bool = True             # let torchvision download when the files are missing
    verify: bool = True               # check Fashion-MNIST's files against their known sizes and checksums
    augment: bool = False             # random crop (zero padding crop_padding) + horizontal flip (where allowed)
    crop_padding: int = 4             # pixels of zero padding before the random crop; 0 = no crop
    flip: bool = True                 # random horizontal flips, only where the dataset allows (never digits)
    partner_prob: float = 0.5         # OT-ViT: probability a training image also gets a same-class partner
    train_subset: Optional[int] = None  # use a fixed random subset of the training set (reduced runs)
    test_subset: Optional[int] = None
    validation_size: Optional[int] = None  # hold out this many training images and evaluate on them, not on test
    pipeline: str = "auto"            # device (split resident on the training device) | loader (DataLoader) | auto = device
    num_workers: int = 0              # DataLoader workers (loader pipeline only)
    synthetic: bool = False           # generated images of the dataset's shape (tests, smoke runs)
    synthetic_train_size: int = 64
    synthetic_test_size: int = 32


@dataclass
class OptimConfig:
    lr: float = 3e-4                  # at train.batch_size = lr_reference_batch; scaled by lr_scaling otherwise
    lr_reference_batch: int = 128     # the batch size lr is given for
    lr_scaling: str = "none"          # none | linear | sqrt: lr * (batch / lr_reference_batch) ** (1 or 1/2)
    weight_decay: float = 0.05
    betas: tuple = (0.9, 0.999)
    warmup_epochs: float = 1.0        # linear warmup from 0, then cosine to min_lr
    min_lr: float = 0.0
    label_smoothing: float = 0.0
    grad_clip: Optional[float] = 1.0  # max global gradient norm; null = off


@dataclass
class RunConfig:
    epochs: int = 100
    batch_size: int = 128             # global batch: split across DDP processes
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    amp: bool = True                  # bf16 autocast on CUDA (ignored on CPU)
    compile: Union[bool, str] = False  # torch.compile: false | true (= model) | model | blocks | auto (model on CUDA, off on CPU)
    compile_mode: Optional[str] = None  # torch.compile's mode (e.g. max-autotune-no-cudagraphs); null = default
    compile_backend: Optional[str] = None  # torch.compile's backend; null = inductor (eager: tracing only, for tests)
    channels_last: bool = True        # channels-last images and weights on CUDA (the patch embedding's conv)
    graph: Union[bool, str] = False   # the whole step (batch, forward, backward, AdamW) as one CUDA graph: false | true | auto
    log_every: int = 50               # steps between progress updates and loss checks (each one waits for the GPU)
    threads: Optional[int] = None     # torch.set_num_threads; null = torch's default
    out_dir: str = "runs/default"
    progress: bool = True             # tqdm bar with loss / accuracy / images per second
    plot: bool = True                 # curves.png after every epoch
    max_steps_per_epoch: Optional[int] = None  # cut epochs short (smoke tests)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optim"]["betas"] = list(d["optim"]["betas"])
        return d


def _check_value(key: str, hint: Any, value: Any) -> Any:
    """Coerce/validate one value against its annotation; ValueError naming the key."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_value(key, a, value)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{key}: expected {' or '.join(getattr(a, '__name__', str(a)) for a in args)}, got {value!r}")
    if hint is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        return tuple(_check_value(f"{key}[{i}]", float, v) for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config key(s) {[f'{prefix}{k}' for k in unknown]}; "
                         f"known under {prefix or 'top level'}: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_value(f"{prefix}{name}", hint, value)
    return cls(**kwargs)


def from_dict(data: dict) -> TrainConfig:
    return check(_build(TrainConfig, data, ""))


def _require(ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{key} must be {what}, got {value!r}")


def check(cfg: TrainConfig) -> TrainConfig:
    """Every value in range and the model buildable, before any data is read or any file written:
    a ValueError naming the key. The model is built on the meta device (no memory, no RNG draw)."""
    import torch

    from .datasets import DATASETS, dataset_info
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    _require(d.dataset in DATASETS, "data.dataset", f"one of {sorted(DATASETS)}", d.dataset)
    for key, value in (("data.train_subset", d.train_subset), ("data.test_subset", d.test_subset)):
        _require(value is None or value > 0, key, "a positive integer or null", value)
    for key, value in (("data.synthetic_train_size", d.synthetic_train_size),
                       ("data.synthetic_test_size", d.synthetic_test_size), ("train.epochs", t.epochs),
                       ("train.batch_size", t.batch_size), ("train.eval_batch_size", t.eval_batch_size)):
        _require(value > 0, key, "a positive integer", value)
    _require(d.num_workers >= 0, "data.num_workers", ">= 0", d.num_workers)
    _require(d.crop_padding >= 0, "data.crop_padding", ">= 0", d.crop_padding)
    _require(d.validation_size is None or d.validation_size > 0, "data.validation_size", "a positive integer or null",
             d.validation_size)
    _require(d.pipeline in PIPELINES, "data.pipeline", f"one of {list(PIPELINES)}", d.pipeline)
    _require(t.compile in COMPILE_CHOICES, "train.compile", "false, true, model, blocks or auto", t.compile)
    _require(t.graph in GRAPH_CHOICES, "train.graph", "false, true or auto", t.graph)
    _require(t.graph is not True or t.compile != "blocks", "train.graph",
             "false or auto with train.compile=blocks (blocks keep OT-ViT's data-dependent gather)", t.graph)
    _require(t.graph is not True or t.compile_mode not in CUDAGRAPH_MODES, "train.graph",
             f"false or auto with train.compile_mode={t.compile_mode} (that mode captures its own CUDA graphs)", t.graph)
    _require(o.lr_scaling in LR_SCALING, "optim.lr_scaling", f"one of {list(LR_SCALING)}", o.lr_scaling)
    _require(o.lr_reference_batch > 0, "optim.lr_reference_batch", "a positive integer", o.lr_reference_batch)
    _require(t.log_every > 0, "train.log_every", "a positive integer", t.log_every)
    _require(0.0 <= d.partner_prob <= 1.0, "data.partner_prob", "in [0, 1]", d.partner_prob)
    # an infinite rate trains to NaN and an infinite warmup has no step count: finite numbers only
    _require(0 < o.lr < math.inf, "optim.lr", "a finite number > 0", o.lr)
    _require(0 <= o.weight_decay < math.inf, "optim.weight_decay", "a finite number >= 0", o.weight_decay)
    _require(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "optim.betas", "two numbers in [0, 1)",
             list(o.betas))
    _require(0 <= o.warmup_epochs < math.inf, "optim.warmup_epochs", "a finite number >= 0", o.warmup_epochs)
    _require(0 <= o.min_lr <= o.lr, "optim.min_lr", "in [0, optim.lr]", o.min_lr)
    _require(0.0 <= o.label_smoothing < 1.0, "optim.label_smoothing", "in [0, 1)", o.label_smoothing)
    _require(o.grad_clip is None or o.grad_clip > 0, "optim.grad_clip", "> 0 or null", o.grad_clip)
    _require(t.threads is None or t.threads > 0, "train.threads", "a positive integer or null", t.threads)
    _require(t.max_steps_per_epoch is None or t.max_steps_per_epoch > 0, "train.max_steps_per_epoch",
             "a positive integer or null", t.max_steps_per_epoch)
    _require(bool(t.out_dir), "train.out_dir", "a folder name", t.out_dir)
    # torch.manual_seed takes 64 bits and the data streams read the low 64 bits of the seed
    _require(0 <= t.seed < 2 ** 63, "train.seed", "an integer in [0, 2^63)", t.seed)
    if t.device != "auto":
        try:
            device = torch.device(t.device)
        except RuntimeError:
            device = None
        _require(device is not None and device.type in ("cpu", "cuda"), "train.device", "auto, cpu, cuda or cuda:N",
                 t.device)
    from .datasets import check_data_dir
    check_data_dir(d.dataset, d.data_dir, d.synthetic)
    from ..models import build_model
    info = dataset_info(d.dataset)
    try:
        with torch.device("meta"):
            model = build_model(m.name, **model_kwargs(m, info))
    except (ValueError, TypeError) as e:
        raise ValueError(f"model: {e}") from None
    _check_backends(model, m.name)
    if t.compile_backend is not None:
        from torch._dynamo import list_backends
        known = list_backends(exclude_tags=())
        _require(t.compile_backend in known, "train.compile_backend", f"null or one of {known}", t.compile_backend)
    if t.compile_mode is not None:
        from torch._inductor import list_mode_options
        modes = list(list_mode_options())
        _require(t.compile_mode in modes, "train.compile_mode", f"null or one of {modes}", t.compile_mode)
    return cfg


def _check_backends(model, name: str) -> None:
    """Every kernel backend named in ``model.attention`` or ``model.ot_backend`` exists: the layers
    look their backend up at their first forward, which would be after the data is read."""
    from ..ops.dispatch import backends
    last_block = f"blocks.{len(model.blocks) - 1}."
    for where, module in model.named_modules():
        wanted, kind = getattr(module, "backend", None), getattr(module, "kind", None)
        known = backends(kind) if isinstance(kind, str) else []
        if wanted is None or wanted == "auto" or not known or wanted in known:
            continue
        key = "model.ot_backend" if name == "otvit" and where.startswith(last_block) else "model.attention"
        raise ValueError(f"{key}: backend must be null, 'auto' or one of {known} for {kind} attention, "
                         f"got {wanted!r}")


def effective_lr(cfg: TrainConfig) -> float:
    """The learning rate training uses: ``optim.lr`` scaled from ``optim.lr_reference_batch`` to
    ``train.batch_size`` by ``optim.lr_scaling`` (sqrt: the square-root rule for Adam-type
    optimizers, Malladi et al. 2022; linear: Goyal et al. 2017). ``optim.min_lr`` scales with it."""
    o = cfg.optim
    ratio = cfg.train.batch_size / o.lr_reference_batch
    return o.lr * {"none": 1.0, "linear": ratio, "sqrt": ratio ** 0.5}[o.lr_scaling]


def model_kwargs(m: ModelConfig, info) -> dict:
    """build_model's keyword arguments for the ``model:`` section and a dataset's image shape."""
    return dict(img_size=info.img_size, in_chans=info.channels, num_classes=info.num_classes,
                patch_size=m.patch_size, embed_dim=m.embed_dim, depth=m.depth, num_heads=m.num_heads,
                mlp_ratio=m.mlp_ratio, dropout=m.dropout, attn_dropout=m.attn_dropout, qkv_bias=m.qkv_bias,
                attention=m.attention, ot_alpha=m.ot_alpha, ot_gamma=m.ot_gamma,
                template_tokens=m.template_tokens, template_grad=m.template_grad,
                ot_queries=m.ot_queries, ot_backend=m.ot_backend)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``["model.attention=sigmoid", "train.epochs=3"]``; values are parsed as YAML scalars."""
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value (e.g. model.attention=sigmoid), got {item!r}")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {p!r} is not a section")
        node[parts[-1]] = _parse_yaml(raw, f"--set {item}") if raw.strip() else ""
    return data


def _parse_yaml(text: Union[str, bytes], where: str):
    """yaml.safe_load, with a YAML syntax error as a ValueError naming ``where`` (the commands print
    it as one ``error:`` line; yaml's own message is a multi-line traceback). A key given twice in
    one mapping is an error too: safe_load would keep the last silently (a second ``train:``
    section would drop the first's settings)."""
    try:
        data = yaml.safe_load(text)
        twice = _repeated_key(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise ValueError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None
    if twice is not None:
        key, line = twice
        raise ValueError(f"{where}: key {key!r} is given twice (line {line}); YAML would keep only the last")
    return data


def _repeated_key(node, prefix: str = "", seen_nodes=None):
    """(dotted key, line) of the first key repeated within one mapping of a composed YAML tree, or None."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if node is None or id(node) in seen_nodes:  # an alias points back at a node already checked
        return None
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":  # merge keys may repeat
                name = f"{prefix}{key}"
                if key in keys:
                    return name, key_node.start_mark.line + 1
                keys.add(key)
            found = _repeated_key(value_node, f"{prefix}{key}." if key is not None else prefix, seen_nodes)
            if found is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _repeated_key(item, prefix, seen_nodes)
            if found is not None:
                return found
    return None


def read_yaml(path: Union[str, Path]):
    """A YAML file's contents ({} when empty); a syntax error is a ValueError naming the file."""
    return _parse_yaml(Path(path).read_bytes(), str(path)) or {}  # bytes: yaml names a bad encoding


def load_config(path: Union[str, Path], overrides: Optional[list[str]] = None) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found (see configs/*.yaml)")
    return from_dict(apply_overrides(read_yaml(path), overrides))
