"""The one preset lookup every built-in family uses: a named config, with fields replaced."""

from __future__ import annotations

from dataclasses import asdict, replace

from paratrain.errors import InvalidValueError


def preset(presets: dict, family: str, config_class: str, name: str, overrides: dict):
    """`presets[name]` with `overrides` replaced; unknown names and fields are refused with the choices."""
    if name not in presets:
        raise InvalidValueError(f"unknown {family} preset {name!r}; choose one of {', '.join(presets)}")
    fields = set(asdict(presets[name]))
    unknown = set(overrides) - fields
    if unknown:
        raise InvalidValueError(f"unknown {config_class} field(s) {sorted(unknown)}; fields are {sorted(fields)}")
    return replace(presets[name], **overrides)
