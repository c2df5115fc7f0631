"""Knobs of the quantizer. The defaults are what `convert.py` uses; the others exist so that
`bench/quality.py` can measure what each technique is worth (docs/quantization.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from quant.candidates import TRELLIS_BITS, parse_setting

TRANSFORMS = ("auto", "none", "perm", "su+perm", "su+sv+perm", "su", "su+sv")
CODES = ("auto", "scalar", "trellis")
MAX_TRELLIS_PASSES = 8  # refinement passes a conversion may ask for (convert.py --trellis-passes)
MAX_TUNE_STEPS = 4096  # convert.py --tune: 2 calibration rows a step


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
    codes: str = "auto"  # auto: per matrix, scalar or trellis codes (docs/format.md §7); scalar | trellis only
    trellis_bits: tuple[int, ...] | None = None  # trellis widths measured; None: 1-6 with codes=auto, 1-8 with trellis
    state_bits: int = 12  # trellis state bits L (at least bits + 1)
    trellis_passes: int = 0  # refinement passes of a trellis matrix's final encoding (quant.trellis.refine)
    tune_steps: int = 0  # end-to-end tuning of row scales and norms after quantization (quant.tune; 0: none)

    def __post_init__(self):
        if self.method not in ("gptq", "rtn"):
            raise ValueError(f"method must be gptq or rtn, not {self.method!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, not {self.transform!r}")
        if self.sensitivity not in ("fisher", "mse"):
            raise ValueError(f"sensitivity must be fisher or mse, not {self.sensitivity!r}")
        if self.codes not in CODES:
            raise ValueError(f"codes must be one of {CODES}, not {self.codes!r}")
        if not 8 <= self.state_bits <= 16:
            raise ValueError(f"trellis state bits must be in 8..16, not {self.state_bits}")
        if not 0 <= self.trellis_passes <= MAX_TRELLIS_PASSES:
            raise ValueError(f"trellis refinement passes must be in 0..{MAX_TRELLIS_PASSES}, not {self.trellis_passes}")
        if not 0 <= self.tune_steps <= MAX_TUNE_STEPS:
            raise ValueError(f"tuning steps must be in 0..{MAX_TUNE_STEPS}, not {self.tune_steps}")
        if self.trellis_bits is not None:
            if not self.trellis_bits or not all(1 <= b <= 8 for b in self.trellis_bits):
                raise ValueError(f"trellis bits must be in 1..8, not {self.trellis_bits}")
            object.__setattr__(self, "trellis_bits", tuple(int(b) for b in self.trellis_bits))
        if self.fixed is not None:
            parse_setting(self.fixed)

    @property
    def trellis_widths(self) -> tuple[int, ...]:
        """The trellis bits per weight to measure. With codes=auto, 7 and 8 are left to the scalar codes
        (at those widths trellis gains little and measuring them costs a third more time)."""
        if self.trellis_bits is not None:
            return self.trellis_bits
        return TRELLIS_BITS if self.codes == "trellis" else TRELLIS_BITS[:6]

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.trellis_bits is not None:
            d["trellis_bits"] = list(self.trellis_bits)  # as JSON stores it (resume compares the two)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def measurement_key(self) -> dict:
        """The options a saved measurement depends on (reusing it with others would be wrong). Scalar-only
        measurements have the keys of measurements made before trellis codes existed."""
        key = {k: getattr(self, k) for k in ("method", "transform", "scale_search", "sensitivity", "mixes", "damp",
                                             "measure_rows", "fisher_rows")}
        if self.codes != "scalar":
            key.update(codes=self.codes, trellis_bits=list(self.trellis_widths), state_bits=self.state_bits)
        return key
