"""A backend's settings, read once from a model's config into a frozen dataclass of typed fields.

Each backend declares its fields as a subclass of `Options` beside its launcher (VllmServeOptions in
launchers/vllm_serve.py, RemoteOptions in proxy/lifecycle/kinds/remote_options.py, ...). A field is
named as in conf/schema.json less the class's PREFIX (`vllm_dtype` is VllmServeOptions.dtype); one
read from a key of another shape (a field every backend has, such as `model_path`) names it with
`setting(key=...)`. A key that is unset or null gives the field's default, as ModelConfig.get does;
the defaults agree with the schema's `default`s (tests/launchers/test_options.py checks both ways,
and that every schema field of the prefix is a field here). Values are not checked again: the
schema did that when the settings were loaded.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Self

if TYPE_CHECKING:
    from proxy.config.model import ModelConfig

_KEY = "llm_pool_key"
_CONVERT = "llm_pool_convert"


def setting(default: Any = None, *, key: str | None = None, convert: Callable[[Any], Any] | None = None,
            factory: Callable[[], Any] | None = None, repr: bool = True) -> Any:
    """A field of an Options class: its default (or a `factory` for one), the config key when it is
    not PREFIX + the field's name, and a `convert` applied to a configured value (the schema lets an
    integer through where the field is a float; a list becomes a tuple, so the options stay frozen).
    `repr=False` leaves a value that may hold a secret out of the options' repr."""
    metadata = {_KEY: key, _CONVERT: convert}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata, repr=repr)
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


def strings(value: Iterable[Any]) -> tuple[str, ...]:
    """A list of arguments (`*_extra_args`, `*_library_path`) as a tuple of strings."""
    return tuple(str(v) for v in value)


@dataclasses.dataclass(frozen=True)
class Options:
    """The base of every backend's options: how its fields are read from a ModelConfig."""

    PREFIX: ClassVar[str] = ""

    @classmethod
    def key_of(cls, field: dataclasses.Field[Any]) -> str:
        """The config key field `field` is read from."""
        return field.metadata.get(_KEY) or cls.PREFIX + field.name

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Every field's config key, mapped to the field's name."""
        return {cls.key_of(f): f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_config(cls, model: ModelConfig) -> Self:
        """The model's settings of this backend, each field once."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = model.options.get(cls.key_of(field))
            if value is not None:
                convert = field.metadata.get(_CONVERT)
                values[field.name] = convert(value) if convert is not None else value
        return cls(**values)

    def value(self, key: str) -> Any:
        """The field read from config key `key`, for tables that map keys to flags (FLAGS); a key
        that is not one of the fields raises KeyError."""
        return getattr(self, self.keys()[key])
