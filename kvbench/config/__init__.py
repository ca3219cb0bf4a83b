"""Typed configuration: one dataclass per Hydra group or option, and the rules across them."""
