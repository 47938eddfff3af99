"""The one typed configuration: YAML in, dotted command-line overrides on top.

Every key is validated up front by pydantic (unknown keys are errors that name the key), and
combinations that make no sense are rejected with the reason before any model is loaded. One module
per section; `opsd train`'s :class:`Config` and the cross-section checks
(:func:`~opsd.config.root.check_combinations`) in :mod:`opsd.config.root`; `opsd eval`'s and
`opsd sft`'s schemas, built from the same sections, in :mod:`opsd.config.commands`. Light on purpose:
pydantic and YAML, no torch.
"""

from opsd.config.base import DeviceSetting, Section, Switch, switch_word
from opsd.config.commands import EVAL_DEFAULTS, SFT_DEFAULTS, EvalCommand, SFTCommand, require, with_defaults
from opsd.config.cpu import CpuTuning
from opsd.config.data import DataConfig
from opsd.config.eval import EvalConfig, EvalSetConfig, GuardConfig
from opsd.config.load import flag_overrides, load_config, save_config, validate
from opsd.config.loss import GRPOConfig, LossConfig, RLSDConfig, TeacherConfig
from opsd.config.model import LoraConfig, ModelConfig
from opsd.config.optim import CheckpointConfig, LoggingConfig, OptimConfig, ParallelConfig
from opsd.config.rollout import ReuseConfig, RolloutConfig, refresh_every_value, resolve_engine
from opsd.config.root import Config, RunKeys

__all__ = [
    "EVAL_DEFAULTS",
    "SFT_DEFAULTS",
    "EvalCommand",
    "SFTCommand",
    "require",
    "with_defaults",
    "CheckpointConfig",
    "Config",
    "CpuTuning",
    "DataConfig",
    "DeviceSetting",
    "EvalConfig",
    "EvalSetConfig",
    "GRPOConfig",
    "GuardConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RLSDConfig",
    "ReuseConfig",
    "RolloutConfig",
    "RunKeys",
    "Section",
    "Switch",
    "TeacherConfig",
    "flag_overrides",
    "load_config",
    "refresh_every_value",
    "resolve_engine",
    "save_config",
    "switch_word",
    "validate",
]
