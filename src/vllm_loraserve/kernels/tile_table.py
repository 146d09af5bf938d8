"""Tile choices tuned before serving (issue 23, item 2): a table that a
sweep on the GPU writes (benchmarks/kernels/engine_grid.py --sweep
--tiles-out) and a server reads at start-up (--loraserve-tiles), as vLLM
reads tuned LoRA kernel configs. Where the table has no entry, the Triton
backend's rules choose (kernels/triton_mbgmm.py: shrink_tiles, stream_tiles,
expand_tiles); the variants of both are compiled at bind, so nothing is
tuned or compiled while serving.

An entry is keyed by the op (`OPS`), the batch's class (`batch_class`),
the module's size (K for the shrinks, the widest slice's N for the expand)
and its slice count: every launch plan of the backend fixes these, so a
plan never runs with another entry's tiles. The key leaves out the pool's
maximum rank and slot count: a sweep tunes at its own, and a server with
other limits takes the same tiles for the class (where a class starts, in
work blocks, follows its slot count).

Invariant: `Tiles` of an entry pass `check_tiles` for its op: their shapes
can launch, and no field is set that the op ignores. A tile too large for
the GPU's shared memory still fails, at bind (the warm-up compiles every
variant), never while serving.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from vllm_loraserve.kernels.batch import JOB_ROWS
from vllm_loraserve.paging.layout import PANEL

# The serving shrink runs on the batch's jobs ("stream", stream-K); "shrink"
# is the split-K shrink of batches without ranks (training, eager tests).
OPS = ("shrink", "stream", "expand")
CLASSES = ("few", "short", "tall")


@dataclass(frozen=True)
class Tiles:
    """Shrink: rank rows (block_n) by input columns (block_k) per step.
    Expand: output columns (block_n) by rank rows (block_k) per step."""

    block_n: int
    block_k: int
    split_k: int = 0  # shrink only; 0: chosen per launch by `auto_split_k`
    num_warps: int = 4
    num_stages: int = 2
    max_regs: int = 0  # registers per thread (Triton's maxnreg) on CUDA; 0: the compiler's
    # Programs an SM on the grid's work axis (triton_mbgmm.block_programs; the
    # stream shrink's whole grid); 0: PROGRAMS_PER_SM, STREAM_PROGRAMS_PER_SM.
    programs_per_sm: int = 0


def batch_class(max_blocks: int, block_m: int) -> str:
    """'few': at most 128 work blocks (a few tokens: a launch's latency
    counts most); 'short': blocks of at most 16 tokens (decode steps);
    'tall': taller blocks (prefill). The backend's rules split batches the
    same way (and the shrinks' by K too, which the table's key holds)."""
    if max_blocks <= 128:
        return "few"
    return "short" if block_m <= 16 else "tall"


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


MAX_TILE = 256  # rows or columns of a tile: larger ones outgrow shared memory


def check_tiles(op: str, t: Tiles) -> None:
    """Raises ValueError where `t` cannot launch for `op`: tile sizes are
    powers of two from 16 (Triton's dot) to MAX_TILE, column tiles divide a
    panel, the stream shrink takes its jobs' rank rows; and where `t` sets
    what `op` ignores (split-K but for the split-K shrink), which a table
    would only seem to tune."""
    problems = []
    if op not in OPS:
        problems.append(f"op must be one of {list(OPS)}")
    if not all(isinstance(getattr(t, f.name), int) and not isinstance(getattr(t, f.name), bool)
               for f in fields(t)):
        problems.append("every field must be an integer")
    else:
        if not (_power_of_two(t.block_n) and _power_of_two(t.block_k)
                and min(t.block_n, t.block_k) >= 16 and max(t.block_n, t.block_k) <= MAX_TILE):
            problems.append(f"block_n and block_k must be powers of two from 16 to {MAX_TILE}")
        column = t.block_n if op == "expand" else t.block_k
        if PANEL % max(column, 1):
            problems.append(f"its column tile {column} must divide the panel ({PANEL})")
        if op == "stream" and t.block_n != JOB_ROWS:
            problems.append(f"the stream shrink's block_n must be {JOB_ROWS} (its jobs' "
                            f"rank rows)")
        if t.split_k < 0 or (t.split_k and not _power_of_two(t.split_k)):
            problems.append("split_k must be 0 (automatic) or a power of two")
        if op != "shrink" and t.split_k:
            problems.append(f"split_k must be 0 for {op!r} (only the split-K shrink splits)")
        if not (_power_of_two(t.num_warps) and t.num_warps <= 16):
            problems.append("num_warps must be a power of two up to 16")
        if not 1 <= t.num_stages <= 8:
            problems.append("num_stages must be 1 to 8")
        if t.programs_per_sm and not (_power_of_two(t.programs_per_sm)
                                      and t.programs_per_sm <= 256):
            problems.append("programs_per_sm must be 0 (the default) or a power of two up "
                            "to 256")
        if t.max_regs and not 24 <= t.max_regs <= 255:
            problems.append("max_regs must be 0 (the compiler's) or 24 to 255")
    if problems:
        raise ValueError(f"tiles {asdict(t)} for {op!r}: " + "; ".join(problems))


Key = tuple[str, str, int, int]  # op, batch class, size, slice count


@dataclass(frozen=True)
class TileTable:
    device: str  # the GPU it was tuned on (torch.cuda.get_device_name)
    triton: str  # Triton's version there
    entries: Mapping[Key, Tiles]

    def __post_init__(self) -> None:
        for (op, cls, size, count), t in self.entries.items():
            where = f"entry ({op}, {cls}, {size}, {count})"
            if cls not in CLASSES:
                raise ValueError(f"{where}: its batch class must be one of {list(CLASSES)}")
            for name, n in (("size", size), ("count", count)):
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"{where}: its {name} must be a positive integer")
            try:
                check_tiles(op, t)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None

    @staticmethod
    def key(op: str, max_blocks: int, block_m: int, size: int, count: int) -> Key:
        """The entry a launch of `op` on such a batch and module would take."""
        return op, batch_class(max_blocks, block_m), size, count

    def to_json(self) -> str:
        rows = [dict(op=op, batch_class=cls, size=size, count=count, tiles=asdict(t))
                for (op, cls, size, count), t in sorted(self.entries.items())]
        return json.dumps(dict(device=self.device, triton=self.triton, entries=rows), indent=1)

    @classmethod
    def from_json(cls, text: str, what: str = "the tile table") -> TileTable:
        try:
            raw = json.loads(text)
            entries = {}
            for row in raw["entries"]:
                key = (row["op"], row["batch_class"], row["size"], row["count"])
                if key in entries:
                    raise ValueError(f"entry {key} appears twice")
                entries[key] = Tiles(**row["tiles"])
            return cls(str(raw["device"]), str(raw["triton"]), entries)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not JSON: {e}") from e
        except (KeyError, TypeError) as e:
            raise ValueError(f"{what} is not a loraserve tile table (device, triton, entries "
                             f"of op, batch_class, size, count, tiles): "
                             f"{type(e).__name__}: {e}") from e
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from e

    @classmethod
    def load(cls, path: str) -> TileTable:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read the tile table {path}: {e}") from e
        return cls.from_json(text, path)

