"""Typed getters over one mapping of an InferenceService spec, naming the field on error."""

from __future__ import annotations

from typing import Any


class SpecError(ValueError):
    """A spec value the operator cannot act on; ``field`` is its path, e.g. spec.replicas."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


class SpecReader:
    """A mapping at `path` (e.g. spec.runtime) with typed, range-checked getters."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise SpecError(path, "must be an object")
        self.data, self.path = data, path

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def sub(self, key: str) -> SpecReader:
        return SpecReader(self.data.get(key), self._at(key))

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def integer(self, key: str, default: int | None, minimum: int | None = None,
                maximum: int | None = None) -> int | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self._at(key), f"must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise SpecError(self._at(key), f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise SpecError(self._at(key), f"must be <= {maximum}, got {value}")
        return value

    def number(self, key: str, default: float | None, low: float, high: float,
               low_open: bool = False) -> float | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(self._at(key), f"must be a number, got {value!r}")
        if value > high or value < low or (low_open and value == low):
            side = "(" if low_open else "["
            raise SpecError(self._at(key), f"must be in {side}{low}, {high}], got {value}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(self._at(key), f"must be true or false, got {value!r}")
        return value

    def string(self, key: str, default: str | None, choices: tuple[str, ...] = ()) -> str | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise SpecError(self._at(key), f"must be a string, got {value!r}")
        if choices and value not in choices:
            raise SpecError(self._at(key), f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SpecError(self._at(key), "must be a list of strings")
        return tuple(value)
