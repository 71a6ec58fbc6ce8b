"""Typed configuration: schemas, checks, the allocation shorthand and the Hydra edge."""

from hpcrl.config.checks import validate
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import Config
from hpcrl.config.shorthand import format_spec, parse_spec

__all__ = ["Config", "ConfigError", "format_spec", "parse_spec", "validate"]
