"""Reading a run spec file: size-checked, YAML 1.2 numbers, no duplicate keys. Part of ``swarm.run.spec``
(which re-exports ``read_spec_yaml``); ``RunSpec.from_yaml`` validates what this reads.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from swarm.errors import ConfigError
from swarm.run.fields import reject

__all__ = ["read_spec_yaml", "MAX_YAML_FILE_BYTES"]

# A commented YAML file is larger than its canonical JSON; this only guards against reading a wrong file.
MAX_YAML_FILE_BYTES = 256 * 1024


def read_spec_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A run spec file parsed but not validated (``RunSpec.from_yaml`` validates it; ``swarm init
    --from-pretrained`` takes the sections other than ``model`` from it)."""
    import yaml  # imported here: only file loading needs PyYAML

    try:
        size = os.path.getsize(path)
        if size > MAX_YAML_FILE_BYTES:
            raise ConfigError(
                f"run spec file {os.fspath(path)!r} is {size} bytes, above {MAX_YAML_FILE_BYTES}; "
                "is this the right file? A run spec is a short YAML file like examples/tiny.yaml."
            )
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(
            f"cannot read run spec file {os.fspath(path)!r} ({e.strerror or e}); check the path, "
            "or start from examples/tiny.yaml"
        ) from e
    try:
        data = yaml.load(text, Loader=_spec_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"run spec file {os.fspath(path)!r} is not valid YAML: {e}. Fix the line shown above."
        ) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise reject("spec", data, "a run spec must be a mapping of keys to values", "Check the spec file.")
    return data


@functools.lru_cache(maxsize=1)
def _spec_yaml_loader() -> type:
    """A SafeLoader that reads ``3e-3`` as a float (PyYAML follows YAML 1.1, which needs ``3.0e-3``)
    and rejects duplicate keys (PyYAML silently keeps the last one, hiding typos)."""
    import yaml

    class SpecLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}; each key may appear once", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    # add_implicit_resolver copies the parent's resolver table first, so SafeLoader is unchanged.
    SpecLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return SpecLoader
