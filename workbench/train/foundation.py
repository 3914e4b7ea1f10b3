"""Fine-tuning: a run that starts from a foundation model file (MACE-MP-0, MACE-OMAT-0, or one of
your own), as ``mace_run_train --foundation_model PATH`` does (naive fine-tuning).

* The file is loaded under the model-loading rules (:mod:`workbench.train.model_file`): nothing
  in it runs unless ``trust_model``.
* Its architecture defines the run: the :data:`ARCHITECTURE` fields of ``TrainConfig`` left at
  their defaults take the file's values (:func:`resolve`); a field set to anything else that
  contradicts the file is an error naming both values.
* The model is rebuilt from the file's configuration (mace's ``extract_config_mace_model``) and
  its weights copied by mace's own ``load_foundations_elements``, for the data's elements
  (``foundation_elements: data``, mace's default) or all the file's (``all``). The average
  neighbour count, scale and shift are the foundation's; the E0s follow ``TrainConfig.e0s``
  (:mod:`workbench.train.e0s`).
* A file with several heads (mace-mh-1) starts from ``foundation_head`` (mace's ``remove_pt_head``).
* A file saved with cuEquivariance layers is converted to e3nn's by mace's converter (it needs
  cuequivariance-torch, which runs on the CPU too); ``TrainConfig.backend`` applies as usual.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workbench.train.config import TrainConfig
from workbench.train.values import ConfigError

__all__ = [
    "ARCHITECTURE",
    "Foundation",
    "FoundationError",
    "build_finetune_model",
    "check_data_elements",
    "estimate_e0s",
    "finetune_stats",
    "load_foundation",
    "mace_run_train_flags",
    "resolve",
    "table_elements",
]

#: TrainConfig field -> the key of mace's ``extract_config_mace_model`` that fixes it
ARCHITECTURE = {
    "num_interactions": "num_interactions",
    "hidden_irreps": "hidden_irreps",
    "max_ell": "max_ell",
    "correlation": "correlation",
    "num_bessel": "num_bessel",
    "num_polynomial_cutoff": "num_polynomial_cutoff",
    "cutoff": "r_max",
    "mlp_irreps": "MLP_irreps",
    "radial_mlp": "radial_MLP",
}
#: model classes the fine-tuning path rebuilds (mace's FoundationMACE)
CLASSES = ("ScaleShiftMACE",)


class FoundationError(ConfigError):
    """A foundation model file that cannot start this run; the message names the file."""


@dataclass(frozen=True)
class Foundation:
    """A foundation model file, loaded and reduced to the head a run starts from."""

    path: Path
    sha256: str
    model: torch.nn.Module  # one head, as in the file otherwise
    heads: tuple[str, ...]  # the file's heads
    head: str  # the head the run starts from
    mace_config: dict  # mace's extract_config_mace_model of ``model``

    @property
    def zs(self) -> list[int]:
        return [int(z) for z in self.model.atomic_numbers]

    @property
    def e0s(self) -> dict[int, float]:
        energies = self.model.atomic_energies_fn.atomic_energies.reshape(-1, len(self.zs))[0]
        return {z: float(e) for z, e in zip(self.zs, energies)}

    def architecture(self) -> dict[str, Any]:
        """The :data:`ARCHITECTURE` fields of ``TrainConfig`` as this file fixes them."""
        c = self.mace_config
        out = {field: c[key] for field, key in ARCHITECTURE.items()}
        out["hidden_irreps"], out["mlp_irreps"] = str(c["hidden_irreps"]), str(c["MLP_irreps"])
        out["radial_mlp"] = [int(n) for n in c["radial_MLP"]]
        out["cutoff"] = float(c["r_max"])
        for name in ("num_interactions", "max_ell", "correlation", "num_bessel", "num_polynomial_cutoff"):
            out[name] = int(out[name])
        return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_foundation(path: str | os.PathLike, trust: bool = False, head: str | None = None) -> Foundation:
    """The foundation model at ``path`` (see the module docstring); cached per file state, so
    the data, the model and a resume check read it once."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FoundationError(f"TrainConfig.foundation_model: {path}: no such model file")
    st = path.stat()
    return _load(str(path), st.st_size, st.st_mtime_ns, trust, head)


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int, trust: bool, head: str | None) -> Foundation:
    from mace.tools.scripts_utils import extract_config_mace_model

    from workbench.train.heads import heads_of, select_head
    from workbench.train.model_file import ModelFileError, load_model, refused_globals

    where = Path(path)
    try:
        if not trust and any(n.startswith("cuequivariance") for n in refused_globals(where)):
            raise FoundationError(_cueq_hint(where))
        model = load_model(where, trust=trust)
    except ModelFileError as exc:
        raise FoundationError(f"TrainConfig.foundation_model: {exc}") from None
    if type(model).__name__ not in CLASSES:
        raise FoundationError(
            f"TrainConfig.foundation_model: {where}: a {type(model).__name__}; fine-tuning starts from a "
            f"{' or '.join(CLASSES)} (mace_run_train's default model)"
        )
    if _holds_cueq(model):
        model = _from_cueq(model, where)
    heads = heads_of(model)
    chosen, model = select_head(model, head, where, option="TrainConfig.foundation_head")
    return Foundation(where, _sha256(where), model.eval(), heads, chosen, extract_config_mace_model(model))


def _holds_cueq(model: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("cuequivariance") for m in model.modules())


def _cueq_hint(path: Path) -> str:
    return (
        f"TrainConfig.foundation_model: {path}: saved with cuEquivariance layers, and cuequivariance-torch is not "
        "installed to read them; `pip install cuequivariance-torch` (pure Python, runs on the CPU too) and the "
        "file is converted to e3nn by mace's own converter before training, or convert it yourself "
        f"(`python -m mace.cli.convert_cueq_e3nn {path}`) and fine-tune from its output"
    )


def _from_cueq(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """A model saved with cuEquivariance layers, converted to e3nn's by mace's converter
    (``mace.cli.convert_cueq_e3nn``); ``TrainConfig.backend`` then applies as to any model."""
    from mace.cli.convert_cueq_e3nn import run

    from workbench.dtypes import default_dtype

    with default_dtype(next(model.parameters()).dtype):  # the converter sets the default dtype
        try:
            return run(model, device="cpu", return_model=True)
        except Exception as exc:
            raise FoundationError(
                f"TrainConfig.foundation_model: {path}: mace's cuEquivariance -> e3nn converter failed "
                f"({type(exc).__name__}: {str(exc)[:160]})"
            ) from None


def foundation_of(config: TrainConfig) -> Foundation | None:
    """The config's foundation model, or None for a run from scratch."""
    if not config.foundation_model:
        return None
    return load_foundation(config.foundation_model, config.trust_model, config.foundation_head)


def resolve(config: TrainConfig) -> TrainConfig:
    """``config`` with the architecture of its foundation model (unchanged without one); a field
    that is not at its default and differs from the file is an error naming both."""
    from workbench.train.replay_options import recipe

    found = foundation_of(config)
    if found is None:
        return config
    config = recipe(config)  # multihead fine-tuning: mace's lr, EMA and loss where the config keeps defaults
    defaults = TrainConfig.__dataclass_fields__
    arch = found.architecture()
    for name, value in arch.items():
        mine, default = getattr(config, name), defaults[name]
        default = default.default_factory() if default.default_factory is not dataclasses.MISSING else default.default
        if mine != default and not _same(mine, value):
            raise FoundationError(
                f"TrainConfig.{name}: {mine!r}, but the foundation model {found.path} has {name} {value!r}; "
                f"leave {name} out (fine-tuning keeps the file's architecture) or start from another model"
            )
    return config.replace(**arch) if any(not _same(getattr(config, k), v) for k, v in arch.items()) else config


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        from e3nn import o3

        try:
            return o3.Irreps(a) == o3.Irreps(b)
        except (ValueError, AssertionError):
            return a == b
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    return a == b


def table_elements(config: TrainConfig) -> list[int] | None:
    """The elements of the graphs' one-hot table when the model keeps all the foundation's
    (``foundation_elements: all``); None: the data's own."""
    found = foundation_of(config)
    return found.zs if found is not None and config.foundation_elements == "all" else None


def check_data_elements(config: TrainConfig, data_zs, where: str) -> None:
    """Refuse data holding an element the foundation model lacks, naming the element."""
    from ase.data import chemical_symbols

    found = foundation_of(config)
    if found is None:
        return
    missing = sorted({int(z) for z in data_zs} - set(found.zs))
    if missing:
        names = ", ".join(f"{chemical_symbols[z]} (Z={z})" for z in missing)
        raise FoundationError(
            f"{where}: element(s) {names} occur in the data but not in the foundation model {found.path}, "
            f"which has {' '.join(chemical_symbols[z] for z in found.zs)}; fine-tune a model that has them, "
            "or leave those structures out (families)"
        )


def finetune_stats(
    config: TrainConfig,
    zs: list[int],
    fitted: dict[int, float],
    configs: list | None = None,
    by_head: dict | None = None,
):
    """The :class:`~workbench.train.stats.ModelStats` of a fine-tuned model over ``zs``: E0s per
    ``config.e0s`` (``fitted``: least squares on the training split; ``configs``: the new
    training structures, for ``estimated``), the rest the foundation's. With ``heads``, each
    head's E0s per its own ``e0s`` (``by_head``: each head's training structures)."""
    from workbench.train.e0s import choose_e0s
    from workbench.train.stats import ModelStats

    found = foundation_of(config)
    c = found.mace_config
    spec = estimate_e0s(found, configs) if config.e0s == "estimated" and not config.heads else config.e0s
    per_head = None
    if config.heads:
        per_head = {h: head_e0s(config, h, list(zs), (by_head or {}).get(h)) for h in config.heads}
    return ModelStats(
        zs=[int(z) for z in zs],
        e0s=list(per_head.values())[-1] if per_head else choose_e0s(spec, list(zs), fitted, found.e0s),
        avg_num_neighbors=float(c["avg_num_neighbors"]),
        shift=float(torch.as_tensor(c["atomic_inter_shift"]).reshape(-1)[0]),
        scale=float(torch.as_tensor(c["atomic_inter_scale"]).reshape(-1)[0]),
        # multihead: pt_head keeps the foundation's E0s, as mace_run_train does
        pt_e0s=[found.e0s[int(z)] for z in zs] if config.multihead_finetuning else None,
        head_e0s=per_head,
    )


def head_e0s(config: TrainConfig, head: str, zs: list[int], configs: list | None) -> list[float]:
    """The E0s of new head ``head`` over ``zs``, per its ``e0s`` (``configs``: its training
    structures); an explicit map must give every element they hold."""
    from workbench.train.e0s import choose_e0s
    from workbench.train.replay_options import head_settings
    from workbench.train.values import ConfigError

    found = foundation_of(config)
    spec = head_settings(config, head)["e0s"]
    if spec == "estimated":
        spec = estimate_e0s(found, configs)
    held = {int(z): 0.0 for c in configs or [] for z in c.atomic_numbers}  # marks the head's elements
    try:
        return choose_e0s(spec, zs, held, found.e0s)
    except ConfigError as exc:
        raise ConfigError(f"TrainConfig.heads.{head}.e0s: {str(exc).split(': ', 1)[1]}") from None


def estimate_e0s(found: Foundation, configs: list | None) -> dict[int, float]:
    """mace's ``--E0s estimated``: the foundation's E0s plus the least-squares correction of its
    energy errors on ``configs`` (mace ``Configuration`` s of the new training data), for the
    elements they hold (``mace.data.utils.estimate_e0s_from_foundation``)."""
    from mace.data.utils import estimate_e0s_from_foundation
    from mace.tools import AtomicNumberTable

    from workbench.dtypes import default_dtype

    if not configs:
        raise FoundationError(
            "TrainConfig.e0s: 'estimated' runs the foundation on the training structures, which a prepared dataset "
            "does not keep in memory; train from the structure file, or use foundation or a map"
        )
    table = AtomicNumberTable(sorted({int(z) for c in configs for z in c.atomic_numbers}))
    with default_dtype(next(found.model.parameters()).dtype):
        est = estimate_e0s_from_foundation(found.model, dict(found.e0s), configs, table, device="cpu")
    return {int(z): float(e) for z, e in est.items()}


def build_finetune_model(config: TrainConfig, stats) -> torch.nn.Module:
    """The foundation model rebuilt over ``stats.zs`` in ``config.dtype`` with its weights (mace's
    ``load_foundations_elements``): one head named ``Default`` with ``stats.e0s``, or for
    multihead fine-tuning heads ``pt_head`` (``stats.pt_e0s``) and ``Default`` (or those of
    ``heads``, ``stats.head_e0s``), each readout a copy of the foundation's."""
    import numpy as np
    from mace import modules
    from mace.tools import AtomicNumberTable
    from mace.tools.finetuning_utils import load_foundations_elements

    from workbench.dtypes import default_dtype
    from workbench.train.replay_options import FT_HEAD, run_heads

    found = foundation_of(config)
    dtype = getattr(torch, config.dtype)
    heads = run_heads(config) or [FT_HEAD]
    if stats.head_e0s:  # several new heads: pt_head's, then each head's in order
        e0s = [stats.pt_e0s, *(stats.head_e0s[h] for h in heads[1:])]
    else:
        e0s = [stats.pt_e0s, stats.e0s] if len(heads) > 1 else [stats.e0s]
    mace_config = dict(found.mace_config, heads=heads, atomic_numbers=list(stats.zs))
    mace_config.update(num_elements=len(stats.zs), atomic_energies=np.array(e0s))
    mace_config.update(atomic_inter_scale=[stats.scale] * len(heads), atomic_inter_shift=[stats.shift] * len(heads))
    with default_dtype(dtype):
        model = modules.ScaleShiftMACE(**mace_config)
        model = load_foundations_elements(
            model,
            found.model,
            AtomicNumberTable(list(stats.zs)),
            load_readout=True,  # mace's default (--foundation_filter_elements True)
            max_L=mace_config["hidden_irreps"].lmax,
            default_dtype=dtype,
        )
    with torch.no_grad():  # mace's copy also overwrites the E0s when the element lists match
        model.atomic_energies_fn.atomic_energies.copy_(torch.tensor(e0s, dtype=dtype))
    return model.to(dtype)


def mace_run_train_flags(config: TrainConfig, replay_files: dict | None = None) -> dict[str, Any]:
    """mace_run_train's fine-tuning flags for a config with a foundation model (mace takes the
    architecture from the file; the architecture flags it is also given are overridden).
    Multihead fine-tuning needs ``replay_files`` (:func:`workbench.train.replay.write_replay`):
    mace is given the structures this run replays, and our lr and EMA decay explicitly."""
    if not config.foundation_model:
        return {}
    flags: dict[str, Any] = {
        "--foundation_model": config.foundation_model,
        "--foundation_model_elements": config.foundation_elements == "all",
        "--multiheads_finetuning": bool(config.multihead_finetuning),
        "--E0s": _mace_e0s(config.e0s),
    }
    if config.heads:
        flags["--heads"] = repr(_mace_heads(config))
    if config.foundation_head:
        flags["--foundation_head"] = config.foundation_head
    if config.multihead_finetuning:
        if not replay_files:
            raise ValueError("multihead fine-tuning: give mace_run_train the replay files (replay.write_replay)")
        flags.update({"--pt_train_file": replay_files["pt_train"], "--pt_valid_file": replay_files["pt_valid"]})
        flags.update({"--force_mh_ft_lr": True, "--lr": config.lr, "--loss": config.loss})
        flags.update({"--weight_pt_head": config.weight_pt_head, "--real_pt_data_ratio_threshold": 0.1})
        if config.ema_decay is not None:
            flags["--ema_decay"] = config.ema_decay
    return flags


def _mace_e0s(e0s) -> str:
    e0s = e0s or "foundation"
    return e0s if isinstance(e0s, str) else "{" + ", ".join(f"{z}: {e!r}" for z, e in e0s.items()) + "}"


def _mace_heads(config: TrainConfig) -> dict[str, dict[str, Any]]:
    """mace's ``--heads`` for ``config.heads``: each head's files, split and E0s (a head without a
    validation file names None, or mace would take ``--valid_file``)."""
    from workbench.train.replay_options import head_settings

    out = {}
    for head in config.heads:
        mine = head_settings(config, head)
        out[head] = {
            "train_file": mine["dataset"],
            "valid_file": mine["valid_dataset"],
            "valid_fraction": mine["valid_fraction"],
            "E0s": _mace_e0s(mine["e0s"]),
        }
    return out
