"""torch.distributed.checkpoint planners for lists of ShardedTensor / ShardedObject items.

DCP's default planners take one tensor per key and rank; ours describe each box of a rank's
items with its global offset, so DCP's own machinery writes the boxes (de-duplicating replicas
across ranks, validating that boxes do not overlap) and on load reads exactly the overlap of
every requested box with the saved ones: resharding to any layout.
"""

import io
import os

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.safe_load import load_torch_file


def _index(key, offsets):
    return key, tuple(offsets)


def _narrow(tensor, offsets, lengths):
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class ShardedSavePlanner(DefaultSavePlanner):
    """Writes the items' boxes and objects; with `resolve(item) -> tensor` the boxes' data are
    placeholders (e.g. meta tensors of the right shape and dtype) and each is produced only when
    DCP writes it."""

    def __init__(self, items, resolve=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.resolve = resolve
        self.tensors = {_index(t.key, t.global_offset): t for t in items
                        if isinstance(t, ShardedTensor) and t.data.numel() and not t.replica}
        self.objects = {o.key: o.value for o in items if isinstance(o, ShardedObject)}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(t.key, torch.Size(t.global_offset)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(torch.Size(t.global_offset), t.data.shape),
                               properties=TensorProperties(dtype=t.data.dtype), size=torch.Size(t.global_shape)))
                 for t in self.tensors.values()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item):
        # Objects are pickled with torch.save and read back with weights_only=True: they must be
        # tensors and plain data (lists, dicts, numbers, strings), which nothing else can read.
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], buffer)
            return buffer
        item = self.tensors[_index(write_item.index.fqn, write_item.index.offset)]
        return self.resolve(item) if self.resolve else item.data.detach()


class ShardedLoadPlanner(DefaultLoadPlanner):
    """Reads the requested boxes (already checked against the metadata) and objects (tensors and
    plain data only: `safe_load`)."""

    def __init__(self, items, checkpoint_dir: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items, self.checkpoint_dir = items, checkpoint_dir
        self.tensors = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        by_key, requests = {}, []
        for item in self.items:
            if isinstance(item, ShardedObject):
                index = MetadataIndex(item.key)
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([0]),
                                         storage_index=index, storage_offsets=torch.Size([0]),
                                         lengths=torch.Size([0])))
            elif item.data.numel():
                by_key.setdefault(item.key, []).append(item)
        for key, boxes in by_key.items():
            chunks = []
            for box in boxes:
                index = _index(key, box.global_offset)
                assert index not in self.tensors, f"two boxes of {key} at {box.global_offset} on one rank"
                self.tensors[index] = box
                chunks.append(ChunkStorageMetadata(torch.Size(box.global_offset), box.data.shape))
            requests += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(requests)

    def load_bytes(self, read_item, value):
        key = read_item.dest_index.fqn
        stored = self.metadata.storage_data[read_item.storage_index].relative_path
        for item in self.items:
            if isinstance(item, ShardedObject) and item.key == key:
                item.value = load_torch_file(value, f"{os.path.join(self.checkpoint_dir, stored)} ({key})",
                                             item.foreign)

    def resolve_tensor(self, read_item):
        box = self.tensors[_index(read_item.dest_index.fqn, read_item.dest_index.offset)]
        return _narrow(box.data, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        pass
