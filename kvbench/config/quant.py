"""How a checkpoint stores its weights: a config.json's ``quantization_config``, read into one
``model.weights_stored`` value (null: in the compute dtype, as a bf16/fp32 copy stores them).

Three published formats are read (and dequantized on load by :mod:`kvbench.quant_weights`):

- ``fp8_e4m3_<M>x<N>``: DeepSeek-V3/V3.2's ``{"quant_method": "fp8", "fmt": "e4m3",
  "weight_block_size": [M, N]}``, each FP8 matrix with a float32 ``weight_scale_inv`` per M x N block;
- ``mxfp4``: GPT-OSS's ``{"quant_method": "mxfp4"}``, its experts in E2M1 with an E8M0 exponent per 32;
- ``nvfp4``: ModelOpt's ``{"quant_method": "modelopt", "quant_algo": "NVFP4"}``, E2M1 with an E4M3
  scale per 16 values and a float32 scale per tensor.

Anything else is refused in one line naming the key as the file writes it. Pure Python: the config
layer imports no torch.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Tuple

from kvbench.core.errors import ConfigError

KEY = "quantization_config"
QUANT_METHODS = ("fp8", "mxfp4", "modelopt")
# one byte per FP8 weight; E2M1: half a byte, and one scale byte per 32 (MXFP4) or 16 (NVFP4) values
WEIGHTS_STORED = ("fp8_e4m3_<M>x<N>", "mxfp4", "nvfp4")
_FP8 = re.compile(r"fp8_e4m3_([1-9]\d*)x([1-9]\d*)")


def fp8_block(stored: Optional[str]) -> Optional[Tuple[int, int]]:
    """The (rows, columns) of an ``fp8_e4m3_<M>x<N>`` format's scale blocks; None for another format."""
    match = _FP8.fullmatch(stored or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_weights_stored(stored: Any, key: str = "model.weights_stored") -> None:
    """A ConfigError naming ``key`` unless ``stored`` is null or one of :data:`WEIGHTS_STORED`."""
    if stored is not None and stored not in ("mxfp4", "nvfp4") and fp8_block(stored) is None:
        raise ConfigError(f"{key}={stored!r}: not a stored weight format (accepted: null, {', '.join(WEIGHTS_STORED)})")


def weights_stored(cfg: Mapping[str, Any]) -> Optional[str]:
    """The ``model.weights_stored`` a config.json's contents ``cfg`` describe: null without a
    ``quantization_config``, else its format, refused naming the key where it is not one of the three."""
    quant = cfg.get(KEY)
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ConfigError(f"{KEY}={quant!r}: must be a JSON object")
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{KEY}.quant_method={method!r}: not a quantized checkpoint format kvbench reads "
                          f"(accepted: {', '.join(QUANT_METHODS)}: DeepSeek's FP8 blocks, GPT-OSS's MXFP4 experts, "
                          "ModelOpt's NVFP4)")
    if method == "mxfp4":
        return "mxfp4"
    if method == "modelopt":
        algo = quant.get("quant_algo")
        if not isinstance(algo, str) or algo.upper() != "NVFP4":
            raise ConfigError(f"{KEY}.quant_algo={algo!r}: not read (accepted with quant_method 'modelopt': NVFP4)")
        group = quant.get("group_size", 16)
        if group != 16:  # the format's block: one E4M3 scale per 16 values
            raise ConfigError(f"{KEY}.group_size={group!r}: NVFP4 scales blocks of 16 values")
        return "nvfp4"
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{KEY}.fmt={fmt!r}: not read (accepted: e4m3, DeepSeek's FP8)")
    # absent: transformers' FineGrainedFP8Config default; null would mean one scale per tensor, not read
    block = quant["weight_block_size"] if "weight_block_size" in quant else [128, 128]
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ConfigError(f"{KEY}.weight_block_size={block!r}: must be [rows, columns] of each scale's block, "
                          "two integers >= 1 (DeepSeek-V3: [128, 128])")
    return f"fp8_e4m3_{block[0]}x{block[1]}"
