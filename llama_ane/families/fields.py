"""Typed reads of a config.json dictionary, and the error a configuration we cannot export raises."""

from __future__ import annotations

import math
from typing import Any

from ..errors import LlamaANEError


class ConfigError(LlamaANEError, ValueError):
    """A checkpoint configuration we cannot export; the message says what and what is supported."""


_MISSING = object()


def json_type(value: Any) -> str:
    """How `value` reads in JSON, for error messages: 'the string "8"', 'a list', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (int, float)):
        return repr(value)
    return {list: "a list", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def filled(d: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`d` with `defaults` where it leaves a field out (or null), as a transformers config class fills them in."""
    return {**defaults, **{k: v for k, v in d.items() if v is not None}}


class Fields:
    """Typed reads of a config dictionary's fields: a field of the wrong JSON type or out of range
    raises a ConfigError naming `origin`, the field, what it is and what it must be. An absent field
    (or null) gives `default`; with no default it is an error."""

    def __init__(self, d: dict[str, Any], origin: str):
        self.d, self.origin = d, origin

    def _get(self, key: str, default: Any) -> Any:
        value = self.d.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.origin} lacks {key}")
            return default
        return value

    def refuse(self, key: str, value: Any, must: str) -> ConfigError:
        return ConfigError(f"{self.origin}: {key} is {json_type(value)}; it must be {must}")

    def integer(self, key: str, default: Any = _MISSING, minimum: int = 1) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.refuse(key, value, "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise self.refuse(key, value, "a positive number")
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self._get(key, False)
        if not isinstance(value, bool):
            raise self.refuse(key, value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, dict):
            raise self.refuse(key, value, "an object (or null)")
        return dict(value)

    def token_ids(self, key: str) -> list[int]:
        """A token id or a list of them (EOS may be either), as a list."""
        value = self._get(key, [])
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise self.refuse(key, value, "a token id or a list of token ids (integers >= 0)")
        return list(ids)

    def layer_types(self, types: Any, kinds: tuple[str, ...]) -> None:
        """Refuse `types` unless it lists num_hidden_layers entries, each one of `kinds`."""
        layers = self.integer("num_hidden_layers")
        if not (isinstance(types, list) and len(types) == layers and all(t in kinds for t in types)):
            named = [f'"{k}"' for k in kinds]
            raise ConfigError(f"{self.origin}: layer_types is {json_type(types)}; it must list num_hidden_layers "
                              f"({layers}) entries, each {', '.join(named[:-1])} or {named[-1]}")


def layer_type_rope(f: Fields, rope: dict[str, Any], full_theta: float,
                    sliding_theta: float) -> tuple[dict[str, Any], float]:
    """transformers 5's `rope_parameters` per layer type, as the global RoPE (its base and scaling, in
    the form the other families use) and the sliding layers' base, each type's default base where it
    gives none. The sliding layers' RoPE must be the default one."""
    where = f"{f.origin} rope_parameters"
    local = Fields(rope, where).mapping("sliding_attention")
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(f"{f.origin}: rope_parameters.sliding_attention has rope_type "
                          f"{local.get('rope_type')!r}; the sliding layers' RoPE must be the default one")
    full = Fields(rope, where).mapping("full_attention")
    full.setdefault("rope_theta", full_theta)
    return full, Fields(local, f"{where}.sliding_attention").number("rope_theta", sliding_theta)
