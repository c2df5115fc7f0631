"""Knobs of the quantizer. The defaults are what `convert.py` uses; the others exist so that
`bench/quality.py` can measure what each technique is worth (docs/quantization.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from quant.candidates import Setting

TRANSFORMS = ("auto", "none", "perm", "su+perm", "su+sv+perm", "su", "su+sv")


@dataclass(frozen=True)
class QuantOptions:
    method: str = "gptq"  # gptq | rtn
    transform: str = "auto"  # auto: per matrix, the lowest-error of su+perm / perm / su+sv+perm
    scale_search: bool = True  # search each group's clipping; False: max-abs scales
    sensitivity: str = "fisher"  # fisher: errors weighted by the output Fisher; mse: unweighted output error
    mixes: bool = True  # measure mixed-width settings (act-ordered channels at +1/+2 bits)
    fixed: str | None = None  # one setting for every matrix (e.g. "4b/g128"): a uniform baseline
    sequential: bool = True  # Hessians from the outputs of already quantized blocks
    damp: float = 0.01  # relative to mean(diag H)
    measure_rows: int = 256  # rows per matrix used to price candidates (errors are scaled to all rows)
    fisher_rows: int = 4  # calibration rows used for the Fisher pass and the final check
    head_group: int = 64

    def __post_init__(self):
        if self.method not in ("gptq", "rtn"):
            raise ValueError(f"method must be gptq or rtn, not {self.method!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, not {self.transform!r}")
        if self.sensitivity not in ("fisher", "mse"):
            raise ValueError(f"sensitivity must be fisher or mse, not {self.sensitivity!r}")
        if self.fixed is not None:
            Setting.parse(self.fixed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def measurement_key(self) -> dict:
        """The options a saved measurement depends on (reusing it with others would be wrong)."""
        return {k: getattr(self, k) for k in ("method", "transform", "scale_search", "sensitivity", "mixes", "damp",
                                              "measure_rows", "fisher_rows")}
