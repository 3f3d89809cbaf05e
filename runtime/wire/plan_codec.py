"""The step plan on the wire: one compact msgpack message per step, the same for every rank.

What makes it small (measured in bench/tp_step.py and tests/tp/test_plan_wire.py):

- arrays travel as raw bytes in their narrowest exact dtype, never as Python lists;
- request ids are interned: a request gets a small integer handle the first step it is
  seen (the message carries the new ``handle -> id`` pairs once) and loses it when it
  appears in ``finished_req_ids``;
- block tables travel as deltas: for each row, how many leading entries equal the row this
  request had in the previous plan, then only the entries after them. A decoding request
  usually sends nothing (it appends a block every ``block_size`` tokens);
- positions and slot mappings are left out when they equal what seq_lens, query_start_loc
  and the block tables imply (checked on every plan, so the codec stays lossless).

Encoder and decoder therefore hold mirrored state (handles and the last block table of
each live request) that changes only with the plans themselves, in order. Every rank
decodes every plan, and a rank that misses one is a failed engine anyway.
"""

from __future__ import annotations

import msgspec
import numpy as np
from shoal.runtime.wire.plan import NewRequestData, StepPlan


class PlanWire(msgspec.Struct, array_like=True):
    step_id: int
    new_handles: list[tuple[int, str]]  # handles assigned by this message
    handles: bytes  # int32 [B]
    input_ids: bytes  # [T], dtype input_ids_dtype
    input_ids_dtype: str
    positions: bytes | None  # int64 [T]; None: derived
    query_start_loc: bytes  # int32 [B+1]
    seq_lens: bytes  # int32 [B]
    table_width: int
    table_keep: bytes  # int32 [B]: leading entries equal to the request's previous row
    table_len: bytes  # int32 [B]: entries up to the last non-zero one
    table_new: bytes  # int32: the entries in [keep, len) of every row, row-major
    slot_mapping: bytes | None  # int64 [T]; None: derived
    sample_rows: bytes  # packed bits [B]
    new_requests: list[NewRequestData]
    finished_req_ids: list[str]
    # KV cache groups past the first (``kv/kv_groups.py``): their tables int32 [G-1, B, width]
    # and slot mappings int64 [G-1, T], whole (no deltas: only mixed sliding-window models)
    extra_groups: int = 0
    group_tables: bytes = b""
    group_slots: bytes = b""


def _narrow_ids(values: np.ndarray) -> tuple[bytes, str]:
    if values.size == 0 or (values.min() >= 0 and values.max() < 2**31):
        return values.astype(np.int32, copy=False).tobytes(), "int32"
    return values.astype(np.int64, copy=False).tobytes(), "int64"


def _row_lengths(tables: np.ndarray) -> np.ndarray:
    """Entries up to and including the last non-zero one (zeros after it are padding)."""
    if tables.shape[1] == 0:
        return np.zeros(tables.shape[0], dtype=np.int32)
    nonzero = tables != 0
    last = tables.shape[1] - nonzero[:, ::-1].argmax(axis=1)
    return np.where(nonzero.any(axis=1), last, 0).astype(np.int32)


def derived_positions(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Each request's new tokens sit at the end of its context."""
    query_lens: np.ndarray = np.diff(query_start_loc.astype(np.int64))
    starts = np.repeat(seq_lens.astype(np.int64) - query_lens, query_lens)
    within = np.arange(int(query_lens.sum()), dtype=np.int64) - np.repeat(
        query_start_loc[:-1].astype(np.int64), query_lens)
    return starts + within


def derived_slot_mapping(query_start_loc: np.ndarray, positions: np.ndarray,
                         block_tables: np.ndarray, block_size: int) -> np.ndarray | None:
    """block_table[row][pos // block_size] * block_size + pos % block_size, or None when a
    position lies outside its row's table (then the mapping cannot be derived)."""
    query_lens: np.ndarray = np.diff(query_start_loc.astype(np.int64))
    rows = np.repeat(np.arange(len(query_lens)), query_lens)
    block_index = positions // block_size
    if positions.size and (positions.min() < 0 or block_index.max() >= block_tables.shape[1]):
        return None
    blocks = block_tables[rows, block_index].astype(np.int64)
    return blocks * block_size + positions % block_size


class _TableState:
    """The last block-table row sent for each handle (both sides keep one)."""

    def __init__(self) -> None:
        self.rows = np.zeros((0, 0), dtype=np.int32)
        self.lens = np.zeros(0, dtype=np.int32)

    def reserve(self, handles: int, width: int) -> None:
        cap, cur_width = self.rows.shape
        if handles <= cap and width <= cur_width:
            return
        grown = np.zeros((max(handles, cap * 2 if handles > cap else cap),
                          max(width, cur_width)), dtype=np.int32)
        grown[:cap, :cur_width] = self.rows
        lens = np.zeros(grown.shape[0], dtype=np.int32)
        lens[:cap] = self.lens
        self.rows, self.lens = grown, lens

    def store(self, handles: np.ndarray, tables: np.ndarray, lens: np.ndarray) -> None:
        width = tables.shape[1]
        self.rows[handles, :width] = tables
        self.rows[handles, width:] = 0
        self.lens[handles] = lens


class PlanEncoder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._handles: dict[str, int] = {}
        self._free: list[int] = []
        self._tables = _TableState()

    def _handles_of(self, req_ids: list[str], new: list[tuple[int, str]]) -> np.ndarray:
        found = list(map(self._handles.get, req_ids))  # one C-level pass in the common case
        for i, handle in enumerate(found):
            if handle is None and (handle := self._handles.get(req_ids[i])) is None:
                handle = self._free.pop() if self._free else len(self._handles)
                self._handles[req_ids[i]] = handle
                new.append((handle, req_ids[i]))
            found[i] = handle
        return np.array(found, dtype=np.int64)

    def encode(self, plan: StepPlan) -> bytes:
        new_handles: list[tuple[int, str]] = []
        handles = self._handles_of(plan.req_ids, new_handles)
        for handle, _ in new_handles:  # a reused handle starts with an empty row
            self._tables.reserve(handle + 1, 0)
            self._tables.lens[handle] = 0
        tables = np.ascontiguousarray(plan.block_tables, dtype=np.int32)
        width = tables.shape[1]
        self._tables.reserve(int(handles.max(initial=-1)) + 1, width)
        lens = _row_lengths(tables)
        prev = self._tables.rows[handles, :width]
        prev_lens = self._tables.lens[handles]
        cols = np.arange(width)
        same_prefix = ((prev == tables) | (cols >= prev_lens[:, None])).all(axis=1)
        keep = np.where(same_prefix & (prev_lens <= lens), prev_lens, 0).astype(np.int32)
        send = (cols >= keep[:, None]) & (cols < lens[:, None])
        self._tables.store(handles, tables, lens)

        qsl = plan.query_start_loc.astype(np.int32, copy=False)
        positions = plan.positions.astype(np.int64, copy=False)
        derived = derived_positions(qsl, plan.seq_lens)
        slots = plan.slot_mapping.astype(np.int64, copy=False)
        derived_slots = derived_slot_mapping(qsl, positions, tables, self.block_size)
        input_ids, input_dtype = _narrow_ids(plan.input_ids)
        wire = PlanWire(
            step_id=plan.step_id,
            new_handles=new_handles,
            handles=handles.astype(np.int32).tobytes(),
            input_ids=input_ids,
            input_ids_dtype=input_dtype,
            positions=None if np.array_equal(positions, derived) else positions.tobytes(),
            query_start_loc=qsl.tobytes(),
            seq_lens=plan.seq_lens.astype(np.int32, copy=False).tobytes(),
            table_width=width,
            table_keep=keep.tobytes(),
            table_len=lens.tobytes(),
            table_new=tables[send].tobytes(),
            slot_mapping=None if derived_slots is not None and np.array_equal(slots, derived_slots)
            else slots.tobytes(),
            sample_rows=np.packbits(plan.sample_rows.astype(bool)).tobytes(),
            new_requests=plan.new_requests,
            finished_req_ids=plan.finished_req_ids,
        )
        if plan.group_block_tables:
            wire.extra_groups = len(plan.group_block_tables)
            wire.group_tables = b"".join(np.ascontiguousarray(t, dtype=np.int32).tobytes()
                                         for t in plan.group_block_tables)
            wire.group_slots = b"".join(np.ascontiguousarray(m, dtype=np.int64).tobytes()
                                        for m in plan.group_slot_mappings)
        for req_id in plan.finished_req_ids:
            if req_id in self._handles:
                self._free.append(self._handles.pop(req_id))
        return msgspec.msgpack.encode(wire)


class PlanDecoder:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[int, str] = {}
        self._by_id: dict[str, int] = {}
        self._tables = _TableState()
        self._decoder = msgspec.msgpack.Decoder(PlanWire)

    def decode(self, data: bytes) -> StepPlan:
        wire = self._decoder.decode(data)
        for handle, req_id in wire.new_handles:
            self._ids[handle] = req_id
            self._by_id[req_id] = handle
            self._tables.reserve(handle + 1, 0)
            self._tables.lens[handle] = 0
        handles = np.frombuffer(wire.handles, dtype=np.int32).astype(np.int64)
        try:
            req_ids = list(map(self._ids.__getitem__, handles.tolist()))
        except KeyError as exc:
            raise ValueError(f"step {wire.step_id}: unknown request handle {exc}") from None
        width = wire.table_width
        self._tables.reserve(int(handles.max(initial=-1)) + 1, width)
        keep = np.frombuffer(wire.table_keep, dtype=np.int32)
        lens = np.frombuffer(wire.table_len, dtype=np.int32)
        cols = np.arange(width)
        tables = np.where(cols < keep[:, None], self._tables.rows[handles, :width], 0)
        tables = tables.astype(np.int32)
        tables[(cols >= keep[:, None]) & (cols < lens[:, None])] = np.frombuffer(
            wire.table_new, dtype=np.int32)
        self._tables.store(handles, tables, lens)

        qsl = np.frombuffer(wire.query_start_loc, dtype=np.int32).copy()
        seq_lens = np.frombuffer(wire.seq_lens, dtype=np.int32).copy()
        positions = derived_positions(qsl, seq_lens) if wire.positions is None \
            else np.frombuffer(wire.positions, dtype=np.int64).copy()
        if wire.slot_mapping is None:
            slots = derived_slot_mapping(qsl, positions, tables, self.block_size)
            if slots is None:
                raise ValueError(f"step {wire.step_id}: slot mapping omitted but not derivable")
        else:
            slots = np.frombuffer(wire.slot_mapping, dtype=np.int64).copy()
        num_reqs = len(req_ids)
        sample_rows = np.unpackbits(np.frombuffer(wire.sample_rows, dtype=np.uint8),
                                    count=num_reqs).astype(bool)
        for req_id in wire.finished_req_ids:
            if req_id in self._by_id:
                del self._ids[self._by_id.pop(req_id)]
        extra = wire.extra_groups
        group_tables = list(np.frombuffer(wire.group_tables, dtype=np.int32).reshape(
            extra, num_reqs, width).copy()) if extra else []
        group_slots = list(np.frombuffer(wire.group_slots, dtype=np.int64).reshape(
            extra, len(slots)).copy()) if extra else []
        return StepPlan(
            group_block_tables=group_tables,
            group_slot_mappings=group_slots,
            step_id=wire.step_id,
            req_ids=req_ids,
            input_ids=np.frombuffer(wire.input_ids, dtype=wire.input_ids_dtype).astype(np.int64),
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            sample_rows=sample_rows,
            new_requests=wire.new_requests,
            finished_req_ids=wire.finished_req_ids,
        )
