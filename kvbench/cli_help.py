"""``kvbench --help``: conf/hydra/help/kvbench.yaml rendered without composing the config. Hydra
renders the same template but first composes the whole config and lists every group through a fresh
copy of its config repository: about 1.5 s of CPU for a page of text (tests/test_hostile_process.py
checks that both agree). The template lists the groups itself, wrapped to 100 columns (Hydra's
``$APP_CONFIG_GROUPS`` puts the 20 model presets on one line of 245): :func:`app_config_groups` is
what it must list, :func:`listed_groups` what it does (tests/test_hostile_output.py compares them).
"""

from __future__ import annotations

import string
from pathlib import Path

from omegaconf import OmegaConf

from kvbench.config.bench import CONF_DIR

HELP_FILE = CONF_DIR / "hydra" / "help" / "kvbench.yaml"


def app_config_groups(conf_dir: Path = CONF_DIR) -> str:
    """Hydra's ``$APP_CONFIG_GROUPS`` for ``conf_dir``: a ``group: option, option`` line per group
    that holds options (nested groups as ``attention/recall``), Hydra's own groups left out."""
    groups = {}
    for folder in conf_dir.rglob("*"):
        group = folder.relative_to(conf_dir).as_posix()
        if not folder.is_dir() or group == "hydra" or group.startswith("hydra/"):
            continue
        options = group_options(folder)
        if options:
            groups[group] = options
    return "".join(f"{group}: {', '.join(groups[group])}\n" for group in sorted(groups))


def listed_groups(help_text: str) -> str:
    """The ``group: option, ...`` lines of ``help_text``'s groups section, each joined from its
    wrapped lines: what :func:`app_config_groups` gives for the config directory it lists."""
    section = help_text.split("Groups (group=option", 1)[1].split("\n", 1)[1].split("\n\n", 1)[0]
    return "".join(line + "\n" for line in section.replace("\n  ", " ").splitlines())


def group_options(folder: Path) -> list:
    """The options of the config group in ``folder``: its YAML files' names."""
    return sorted(p.stem for p in folder.glob("*.yaml") if p.is_file())


def render() -> str:
    """The help text, as Hydra prints it for conf/config.yaml without overrides."""
    node = OmegaConf.create({"hydra": {"help": OmegaConf.load(HELP_FILE)}})
    return string.Template(node.hydra.help.template).substitute(APP_CONFIG_GROUPS=app_config_groups())
