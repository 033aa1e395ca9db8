"""Method registry: name -> Method dataclass."""

from __future__ import annotations

from kvcal.errors import KvcalError

METHODS: dict[str, type] = {}


def register(cls):
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name} registered twice")
    METHODS[cls.name] = cls
    return cls


def method_class(name: str):
    _load_all()
    if name not in METHODS:
        raise KvcalError(f"unknown method '{name}' (known: {', '.join(sorted(METHODS))})")
    return METHODS[name]


def build_method(name: str, config: dict | None = None):
    return method_class(name).from_config(config or {})


def all_methods() -> dict[str, type]:
    _load_all()
    return dict(METHODS)


def _load_all() -> None:
    # Importing the modules registers their methods.
    from kvcal.methods import baselines, kvquant, skvq  # noqa: F401


def codec_for_artifact(artifact, loaded, path="artifact"):
    """The codec an artifact describes, after checking it was made for this model."""
    from kvcal.artifact import check_model

    check_model(artifact, loaded, path)
    method = build_method(artifact.method, artifact.config)
    return method, method.build_codec(artifact.tensors, loaded.dims)
