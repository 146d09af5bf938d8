"""Page loads packed in one launch (`--loraserve-pack triton`): the pack
tables on the device, and the launch.

A reader builds each adapter's pack table on the host (paging/layout.py
`pack_table`). A load needs it on the device without waiting for the device:
a copy from pageable memory would synchronize the stream, and nothing may be
pinned while serving. So tables are copied through a ring of pinned rows
allocated at bind, and kept on the device by content: adapters whose files
share a layout (same rank, targets and writer) share one table, and a load
rarely copies one at all.

Invariants: a staging row is rewritten only once the copy that last read it
has completed (its event; a load that finds the next row still busy is
packed with torch instead of waiting for the device); a kept table is used
on a stream only after its copy (the stream waits on its event), and the
allocator knows every stream that used it (`record_stream`), so dropping it
from the cache is safe.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from vllm_loraserve.adapters.peft import RawWeights
from vllm_loraserve.paging.layout import PACK_COLUMNS, AdapterPlacement, LayerLayout, pack_table
from vllm_loraserve.worker.host_tier import HostAdapter, by_layer

STAGING_ROWS = 16  # tables in flight to the device at once
KEPT_TABLES = 256  # distinct file layouts kept on the device (40 bytes a layer and segment)


def file_table(layout: LayerLayout, num_layers: int, placement: AdapterPlacement,
               raw: RawWeights, where: dict[str, tuple[int, str]]) -> np.ndarray | None:
    """The pack table of a file the reader read (`where`: module path ->
    (layer, slice name)), or None where one launch cannot pack it."""
    return pack_table(layout, placement, by_layer(where, raw.modules, range(num_layers)))


class TablePacker:
    def __init__(self, layout: LayerLayout, num_layers: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """Before serving (it pins its staging rows): at bind."""
        if device.type != "cuda":
            raise ValueError("--loraserve-pack triton packs on a CUDA device; this one is "
                             f"{device}")
        # Here, not at the module's top: engines that pack with torch need no Triton.
        from vllm_loraserve.kernels.triton_pack import pack_streams
        self._pack_streams = pack_streams
        self.layout, self.num_layers, self.dtype, self.device = layout, num_layers, dtype, device
        self._max_rows = num_layers * layout.num_segments
        self._staging = torch.empty(STAGING_ROWS, self._max_rows, len(PACK_COLUMNS),
                                    dtype=torch.int64, pin_memory=True)
        self._staged: list[torch.cuda.Event | None] = [None] * STAGING_ROWS
        self._next = 0
        self._kept: OrderedDict[bytes, tuple[torch.Tensor, torch.cuda.Event]] = OrderedDict()
        self._max_cols = max(max(s.in_features, s.out_features) for s in layout.slices)

    def _table(self, rows: np.ndarray) -> torch.Tensor | None:
        """`rows` on the device, usable on the current stream; None where
        the next staging row's last copy has not completed (16 new tables
        since: a burst of new file layouts)."""
        key = rows.tobytes()
        kept = self._kept.get(key)
        stream = torch.cuda.current_stream(self.device)
        if kept is None:
            if len(rows) > self._max_rows:
                raise ValueError(f"a pack table of {len(rows)} rows; this model has at most "
                                 f"{self._max_rows}")
            i = self._next
            if self._staged[i] is not None and not self._staged[i].query():
                return None
            self._next = (i + 1) % STAGING_ROWS
            stage = self._staging[i, :len(rows)]
            stage.copy_(torch.from_numpy(rows))
            table = stage.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            self._staged[i] = copied
            kept = self._kept[key] = (table, copied)
            if len(self._kept) > KEPT_TABLES:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        table, copied = kept
        stream.wait_event(copied)
        table.record_stream(stream)
        return table

    def pack(self, entry: HostAdapter, data: torch.Tensor, layers: range
             ) -> torch.Tensor | None:
        """The entry's streams of `layers` ([len(layers), pages * page_size])
        from `data` (its file's bytes on the device, at the file's offsets),
        on the current stream; None where its table cannot reach the device
        without waiting (`_table`): the caller packs with torch."""
        table = self._table(entry.pack_table)
        if table is None:
            return None
        p = entry.placement
        file_dtype = next(iter(entry.weights.modules.values()))[0].dtype
        n = data.numel() - data.numel() % file_dtype.itemsize
        out = torch.zeros(len(layers), p.num_pages * self.layout.page_size, dtype=self.dtype,
                          device=self.device)
        self._pack_streams(data[:n].view(file_dtype), table, out, p.rank, entry.scaling,
                           self._max_cols, self.layout.panel, layers)
        return out

    def warm_up(self) -> None:
        """Launch the kernel once per file dtype, so no load compiles it
        (and CUDA loads it here: a first launch waits for the device)."""
        rows = np.array([[0, 0, 1, 0, 0], [0, 0, 1, 1, 0]], dtype=np.int64)  # an A and a B
        for file_dtype in (torch.bfloat16, torch.float16, torch.float32):
            src = torch.zeros(16, dtype=file_dtype, device=self.device)
            out = torch.zeros(1, self.layout.panel, dtype=self.dtype, device=self.device)
            self._pack_streams(src, self._table(rows), out, 1, 1.0, 1, self.layout.panel)
