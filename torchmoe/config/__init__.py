"""Job configuration: the typed `JobConfig`, loading (TOML + `--section.key` flags) and validation."""

from torchmoe.config.degrees import resolve_degrees
from torchmoe.config.errors import ConfigError
from torchmoe.config.job_config import JobConfig
from torchmoe.config.job_file import job_config_from_dict, load_toml_config, write_config_toml
from torchmoe.config.loader import load_job_config
from torchmoe.config.validate import validate_sections

__all__ = [
    "ConfigError",
    "JobConfig",
    "job_config_from_dict",
    "load_job_config",
    "load_toml_config",
    "resolve_degrees",
    "validate_sections",
    "write_config_toml",
]
