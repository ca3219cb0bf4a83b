"""Hydra's reading of a conf/ file, kept for the session by the file's bytes.

Every compose (conftest.compose, each in-process ``kvbench.cli`` run) has Hydra read and parse every
YAML file its defaults list names again: ~20 % of a compose's ~0.13 s of CPU, and the suite composes
a few hundred times per process. The parse of the same bytes at the same path is the same config, so
it is kept, keyed by the path and the file's whole content (a test that writes a conf file, even twice
within one tick of the file clock, is read as written), and each read gets its own deep copy, as a
fresh parse would give (Hydra merges into what it loads).
"""

import copy
import os

from hydra.core.plugins import Plugins
from hydra.plugins.config_source import ConfigSource

# The class Hydra reads file:// with: its plugin discovery loads its own copy of the module, so this
# is not hydra._internal.core_plugins.file_config_source's class as an import would give it.
FileConfigSource = next(c for c in Plugins.instance().discover(ConfigSource) if c.scheme() == "file")
_parsed: dict = {}
_read_and_parse = FileConfigSource.load_config


def _load_config(self, config_path: str):
    full_path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
    try:
        with open(full_path, "rb") as f:
            key = (self.provider, self.path, full_path, f.read())
    except OSError:  # Hydra's own error for a file that is not there
        return _read_and_parse(self, config_path)
    if key not in _parsed:
        _parsed[key] = _read_and_parse(self, config_path)
    return copy.deepcopy(_parsed[key])


def install() -> None:
    FileConfigSource.load_config = _load_config
