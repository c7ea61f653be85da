"""Rotary cos/sin read from tables by position, for programs the device computes in bfloat16 (ai200).

A rotary embedding computes ``cos(position * inv_freq)`` on the device. In bfloat16 (8 significant
bits) the angle itself is rounded: at position 500 an angle of ~500 rad is off by up to 1 rad,
which turns every retained key (Qwen2.5-VL at 3B widths: keys at 0.11-0.56 of their range after
a 128-512 token prefill, docs/decisions/044-ai200-bfloat16.md). QEfficient never computes the
angle on the device: its rotary modules hold ``cos_cached`` / ``sin_cached`` tables computed in
fp32 for ``original_max_seq_len`` positions, stored in the model dtype, and gather their rows by
position ids (quic/efficient-transformers at ebf55e8,
``QEfficient/transformers/models/llama/modeling_llama.py`` ``QEffLlamaRotaryEmbedding``,
``qwen2_5_vl/modeling_qwen2_5_vl.py`` ``qeff_prepare_mrope_cos_sin``). Then a cos/sin value is
rounded to bf16 once (relative error 2**-9), which is what transformers' own bf16 run does
(``cos.to(x.dtype)``).

:func:`use_rotary_tables` does this for any Hugging Face rotary module of the text model (a
module with an ``inv_freq`` buffer whose ``forward(x, position_ids, ...)`` returns cos and sin),
without knowing its layout. The tables are measured from the module's own fp32 forward: for each
position axis (1-D rotary: one; M-RoPE: the rows of ``position_ids``) the module runs on positions
``0..N-1`` along that axis and zeros on the others; each output element then depends on exactly
one axis (M-RoPE's section picks, interleaved or not) or on none (unrotated dims). The distinct
columns make one table ``[N, K]`` in bfloat16; the traced forward gathers rows per axis and picks
each element's column with a constant index (a value move, no arithmetic on the device).
A module whose outputs do not decompose so is left as it is (and said).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

#: Stored dtype of the tables (the device's compute dtype on ai200).
TABLE_DTYPE = torch.bfloat16


@contextlib.contextmanager
def _not_traced():
    """Compute eagerly inside a TorchScript trace (the tables become constants of the graph)."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


def is_rotary(module: nn.Module) -> bool:
    """A Hugging Face rotary embedding: an ``*inv_freq`` buffer and ``forward(x, position_ids, ...)``."""
    if not any(name.endswith("inv_freq") for name in module._buffers):
        return False
    params = list(inspect.signature(module.forward).parameters)
    return params[:2] == ["x", "position_ids"]


class RotaryLayout:
    """One rotary module's outputs as gathers from a position table (for one argument set).

    Attributes:
        table: [N, W] bfloat16: the distinct cos columns, then the distinct sin columns.
        index: [F] int64: output element f is column ``index[f]`` of the rows gathered per axis
            and concatenated ([axes * W], axis-major).
        shapes: Each output's shape with batch 1 and sequence N ((*lead, 1, N, *rest)).
        axes: None for [batch, seq] position ids, else the rows of [axes, batch, seq] ones.
    """

    def __init__(self, table: torch.Tensor, index: torch.Tensor, shapes: list[torch.Size], axes: int | None):
        self.table, self.index, self.shapes, self.axes = table, index, shapes, axes

    def gather(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The module's outputs at ``position_ids`` ([batch, seq] or [axes, batch, seq])."""
        rows = position_ids[None] if self.axes is None else position_ids  # [axes, batch, seq]
        table = self.table.to(torch.float32)
        picked = torch.cat([table[rows[a]] for a in range(rows.shape[0])], dim=-1)  # [b, s, axes*2K]
        flat = picked[..., self.index]  # [b, s, F]
        outputs, start = [], 0
        for shape in self.shapes:
            lead, rest = shape[:-3], shape[-1:]
            size = int(torch.Size(lead).numel() * rest.numel())
            part = flat[..., start : start + size].reshape(*flat.shape[:2], *lead, *rest)
            outputs.append(part.movedim((0, 1), (len(lead), len(lead) + 1)).to(dtype))
            start += size
        return tuple(outputs)


def measure_layout(
    module: nn.Module, positions: int, axes: int | None, extra: tuple = ()
) -> RotaryLayout | None:
    """:class:`RotaryLayout` of ``module`` for ``positions`` rows, or None when it does not decompose.

    Args:
        module: The rotary module (fp32 buffers).
        positions: Table rows (largest position + 1).
        axes: None for [batch, seq] position ids, else the rows of [axes, batch, seq] ones.
        extra: Further forward arguments (e.g. Gemma 3's ``layer_type``).
    """
    count = 1 if axes is None else axes
    x = torch.zeros(1, dtype=torch.float32)
    ramp = torch.arange(positions)
    runs = []
    with torch.no_grad():
        for axis in range(count):
            ids = torch.zeros(count, 1, positions, dtype=torch.long)
            ids[axis, 0] = ramp
            out = module(x, ids[0] if axes is None else ids, *extra)
            if not isinstance(out, tuple) or len(out) != 2:
                return None
            runs.append(out)
    shapes = [o.shape for o in runs[0]]
    if any(len(s) < 3 or s[-2] != positions or s[-3] != 1 for s in shapes):
        return None
    # [axis][N, F]: each output moved to (N, *lead, *rest) and flattened, cos then sin.
    flat = [torch.cat([o.movedim(-2, 0).reshape(positions, -1).float() for o in run], dim=1) for run in runs]
    split = flat[0].shape[1] // 2 if shapes[0] == shapes[1] else None
    varies = torch.stack([(f.amax(0) - f.amin(0)) > 0 for f in flat])  # [axes, F]
    if (varies.sum(0) > 1).any() or split is None:
        return None
    owner = torch.where(varies.any(0), varies.float().argmax(0), 0)  # constant elements: axis 0
    columns = torch.stack([flat[a][:, f] for f, a in enumerate(owner.tolist())], dim=1)  # [N, F]
    halves = (columns[:, :split], columns[:, split:])
    uniques = [torch.unique(h, dim=1, return_inverse=True) for h in halves]
    width = sum(u.shape[1] for u, _ in uniques)
    table = torch.cat([u for u, _ in uniques], dim=1).to(TABLE_DTYPE)  # [N, 2K]
    within = torch.cat([uniques[0][1], uniques[1][1] + uniques[0][0].shape[1]])
    index = owner * width + within
    layout = RotaryLayout(table, index, shapes, axes)
    # Self-check at scattered positions: the gathered outputs are the module's to bf16 rounding.
    probe = torch.randint(0, positions, (count, 2, 5))
    probe_ids = probe[0] if axes is None else probe
    with torch.no_grad():
        expected = module(x, probe_ids, *extra)
    try:
        got = layout.gather(probe_ids, torch.float32)
    except RuntimeError:
        return None
    for e, g in zip(expected, got):
        if e.shape != g.shape or not torch.allclose(e.float(), g, rtol=2**-7, atol=2**-7):
            return None
    return layout


class TableRotary(nn.Module):
    """Stands in for a rotary module: its outputs gathered from tables (built on first use)."""

    def __init__(self, original: nn.Module, positions: int):
        super().__init__()
        self.original = original
        self.positions = positions
        self.layouts: dict[tuple, RotaryLayout | None] = {}
        self.angle_table: torch.Tensor | None = None  # [N, D] bf16: cos | sin of position x inv_freq

    def __getattr__(self, name: str):
        """The original module's attributes (``inv_freq``, ``attention_scaling``, ``config``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["original"], name)

    def angle_cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin of ``position_ids x inv_freq`` times ``attention_scaling``, from a table.

        For families that compute the angles themselves from the module's ``inv_freq`` (see
        :func:`angle_cos_sin`): [..., D/2] each.
        """
        if self.angle_table is None:
            with _not_traced(), torch.no_grad():
                ramp = torch.arange(self.positions, dtype=torch.float32)[:, None]
                angles = ramp * self.original.inv_freq.float()
                scale = getattr(self.original, "attention_scaling", 1.0)
                table = torch.cat([torch.cos(angles) * scale, torch.sin(angles) * scale], dim=-1)
                self.angle_table = table.to(TABLE_DTYPE)
        table = self.angle_table.to(torch.float32)[position_ids]
        half = table.shape[-1] // 2
        return table[..., :half], table[..., half:]

    @property
    def used(self) -> bool:
        """Whether a traced call read the tables (False: never called, or no decomposition)."""
        tables = any(layout is not None for layout in self.layouts.values())
        return tables or self.angle_table is not None

    def forward(self, x, position_ids, *extra):
        """The original module's (cos, sin), read from the table at ``position_ids``."""
        axes = None if position_ids.dim() == 2 else int(position_ids.shape[0])
        key = (axes, *extra)
        if key not in self.layouts:
            with _not_traced():
                self.layouts[key] = measure_layout(self.original, self.positions, axes, tuple(extra))
        layout = self.layouts[key]
        if layout is None:  # the layout does not decompose: computed as transformers does
            return self.original(x, position_ids, *extra)
        return layout.gather(position_ids, x.dtype)


def angle_cos_sin(rotary: nn.Module, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of ``position_ids x rotary.inv_freq`` (times ``attention_scaling``), [..., D/2].

    For family code that computes the rotary angles itself: from the tables when ``rotary`` is a
    :class:`TableRotary` (a bf16 export), else computed as transformers computes them.
    """
    if isinstance(rotary, TableRotary):
        return rotary.angle_cos_sin(position_ids)
    angles = position_ids[..., None].float() * rotary.inv_freq.float()
    scale = getattr(rotary, "attention_scaling", 1.0)
    return torch.cos(angles) * scale, torch.sin(angles) * scale


#: Most positions a table holds. A model declaring 10,485,760 positions would need
#: 2.7 GB of bf16, a graph constant beyond protobuf's 2 GiB (the TorchScript exporter fails), and
#: 5.4 GB of fp32 while it is measured. 131,072 positions are 33.5 MB at 128 columns; the export
#: records the bound and a spec whose ``ctx_len`` passes it is refused (compile/inputs.py).
MAX_TABLE_ROWS = 1 << 17


def table_rows(module: nn.Module) -> int:
    """Positions a table holds: ``max_position_embeddings`` (as QEfficient's), capped at MAX_TABLE_ROWS."""
    config = getattr(module, "config", None)
    rows = getattr(module, "original_max_seq_len", None) or getattr(config, "max_position_embeddings", None)
    return min(int(rows or 4096), MAX_TABLE_ROWS)


def use_rotary_tables(text_model: nn.Module) -> dict[str, TableRotary]:
    """Replace every rotary module of ``text_model`` by a :class:`TableRotary`, by name.

    A family that reads the module's buffers instead of calling it (Llama 4's complex rotary)
    still finds them (the stand-in forwards attribute reads); :attr:`TableRotary.used` says
    whether a call took the tables.
    """
    replaced = {}
    for name, module in list(text_model.named_modules()):
        for child_name, child in list(module.named_children()):
            if is_rotary(child) and not isinstance(child, TableRotary):
                table = TableRotary(child, table_rows(child))
                setattr(module, child_name, table)
                replaced[f"{name}.{child_name}" if name else child_name] = table
    return replaced
